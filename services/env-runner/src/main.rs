fn main() -> anyhow::Result<()> {
    relay_kit::service::main(
        "env-runner",
        |c| c.env_runner.threads,
        relay_env_runner::run,
    )
}
