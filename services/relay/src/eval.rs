//! `relay eval use <name> [--set key=value]...`: publishes an `EvalControl`
//! on `relay.<run>.eval.control`; every running evaluator copy switches to
//! that plugin (or logs and counts a refusal) without restarting.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use relay_proto::{EvalControl, Subjects, SCHEMA_VERSION};

/// Flags of `relay eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: EvalCommand,
}

/// `relay eval <command>`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum EvalCommand {
    /// Switch the running evaluators to plugin NAME (greedy, stochastic, threshold, record).
    Use {
        /// Plugin name.
        name: String,
        /// Plugin option `key=value` (repeatable), e.g. `--set level=150`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        options: Vec<String>,
        /// Run id; defaults to the run of `<state-dir>/stack.json`.
        #[arg(long)]
        run_id: Option<String>,
        /// NATS URL; defaults to the one of `<state-dir>/stack.json`.
        #[arg(long)]
        nats_url: Option<String>,
        /// Folder holding the stack's state.
        #[arg(long, default_value = ".relay")]
        state_dir: PathBuf,
    },
}

/// Parses `key=value` options.
pub fn parse_options(options: &[String]) -> Result<Vec<(String, String)>> {
    options
        .iter()
        .map(|o| match o.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
            _ => bail!("--set {o:?}: expected key=value"),
        })
        .collect()
}

/// Publishes the control message.
pub async fn send(nats_url: &str, run_id: &str, control: &EvalControl) -> Result<()> {
    let client = async_nats::connect(nats_url)
        .await
        .with_context(|| format!("connecting to {nats_url}"))?;
    client
        .publish(
            Subjects::new(run_id).eval_control(),
            relay_proto::encode(control).into(),
        )
        .await?;
    client.flush().await?;
    Ok(())
}

/// `relay eval`.
pub fn eval(args: EvalArgs) -> Result<()> {
    let EvalCommand::Use {
        name,
        options,
        run_id,
        nats_url,
        state_dir,
    } = args.command;
    let options = parse_options(&options)?;
    // Refuse here what every evaluator would refuse.
    relay_evaluator::plugins::build(&name, &options).map_err(anyhow::Error::msg)?;
    let record = || -> Result<crate::stack::StackRecord> {
        let path = state_dir.join("stack.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("no running stack recorded in {}", path.display()))?;
        Ok(serde_json::from_str(&text)?)
    };
    // `@last` is the run of the recorded stack.
    let run_id = run_id.filter(|r| r != "@last");
    let (run_id, nats_url) = match (run_id, nats_url) {
        (Some(r), Some(n)) => (r, n),
        (r, n) => {
            let rec = record()?;
            (r.unwrap_or(rec.run_id), n.unwrap_or(rec.nats_url))
        }
    };
    relay_proto::validate_run_id(&run_id).map_err(anyhow::Error::msg)?;
    let control = EvalControl {
        schema: SCHEMA_VERSION,
        evaluator: name.clone(),
        options,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(send(&nats_url, &run_id, &control))?;
    println!("relay: evaluators of {run_id} switch to {name}");
    Ok(())
}
