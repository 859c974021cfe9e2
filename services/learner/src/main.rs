fn main() -> anyhow::Result<()> {
    // Text runs train an LLM adapter: they get the LLM's thread budget.
    relay_kit::service::main(
        "learner",
        |c| if c.is_text_game() { c.llm.threads } else { 1 },
        relay_learner::run,
    )
}
