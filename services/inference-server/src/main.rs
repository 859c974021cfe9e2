fn main() -> anyhow::Result<()> {
    relay_kit::service::main(
        "inference-server",
        |c| {
            if c.serves_llm() {
                c.llm.threads
            } else {
                c.inference.threads
            }
        },
        relay_inference_server::run,
    )
}
