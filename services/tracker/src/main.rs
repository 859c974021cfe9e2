fn main() -> anyhow::Result<()> {
    relay_kit::service::main("tracker", |_| 1, relay_tracker::run)
}
