fn main() -> anyhow::Result<()> {
    relay_kit::service::main(
        "inference-server",
        |c| c.inference.threads,
        relay_inference_server::run,
    )
}
