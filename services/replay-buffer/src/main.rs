fn main() -> anyhow::Result<()> {
    relay_kit::service::main("replay-buffer", |_| 1, relay_replay_buffer::run)
}
