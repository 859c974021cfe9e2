fn main() -> anyhow::Result<()> {
    relay_kit::service::main("evaluator", |_| 1, relay_evaluator::run)
}
