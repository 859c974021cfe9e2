fn main() -> anyhow::Result<()> {
    relay_kit::service::main("learner", |_| 1, relay_learner::run)
}
