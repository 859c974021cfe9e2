//! `relay scale <service>=<n>...`: change the number of copies of a service
//! in a running `relay up` stack.
//!
//! `relay scale` sends a [`ScaleRequest`] per service on the NATS request
//! subject `relay.<run>.supervisor.scale`, which the supervisor (`relay up`)
//! answers. New copies join the existing queue groups and the supervisor
//! replies once they are healthy; removed copies (the newest first) get
//! SIGTERM and drain, SIGKILL after [`DRAIN_GRACE`], and the reply carries
//! their exit codes. `stack.json` and the Prometheus targets follow.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use relay_proto::{ScaleReply, ScaleRequest, StoppedCopy, Subjects, MAX_COPIES, SCHEMA_VERSION};

use crate::stack::{has_exited, kill_group, Proc, Stack, StackRecord, StartState, SERVICES};

/// How long a removed copy may take to drain before it is killed.
pub const DRAIN_GRACE: Duration = Duration::from_secs(15);
/// How long a new copy may take to answer `/healthz`.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Flags of `relay scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// `<service>=<copies>`, e.g. `env-runner=3 inference-server=2`.
    #[arg(value_name = "SERVICE=N", required = true)]
    pub targets: Vec<String>,
    /// Folder holding the stack's state (`stack.json`).
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
}

/// Parses `service=n` and refuses what the supervisor would refuse.
pub fn parse_target(target: &str) -> Result<(String, u32)> {
    let Some((service, n)) = target.split_once('=') else {
        bail!("{target:?}: expected <service>=<copies>, e.g. env-runner=3");
    };
    let service = service.trim();
    let copies: u32 = n
        .trim()
        .parse()
        .with_context(|| format!("{target:?}: {n:?} is not a number of copies"))?;
    check(service, copies).map_err(anyhow::Error::msg)?;
    Ok((service.to_string(), copies))
}

/// The supervisor's rules: a known service, at most [`MAX_COPIES`], at
/// least one learner.
pub fn check(service: &str, copies: u32) -> Result<(), String> {
    if !SERVICES.contains(&service) {
        return Err(format!(
            "{service:?} is not a service; the services are {SERVICES:?}"
        ));
    }
    if service == "learner" && copies == 0 {
        return Err("a run needs at least one learner; cannot scale it to 0".into());
    }
    if copies > MAX_COPIES {
        return Err(format!("{copies} copies is over the limit of {MAX_COPIES}"));
    }
    Ok(())
}

pub fn read_record(state_dir: &Path) -> Result<StackRecord> {
    let path = state_dir.join("stack.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no running stack recorded in {} (start one with `relay up`)",
            path.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
}

/// Sends one scale request to the supervisor of `run_id` and returns its reply.
pub async fn request(
    client: &async_nats::Client,
    run_id: &str,
    service: &str,
    copies: u32,
) -> Result<ScaleReply> {
    let req = ScaleRequest {
        schema: SCHEMA_VERSION,
        service: service.to_string(),
        copies,
    };
    // The supervisor listens once every service is healthy: a stack that is
    // still starting has no responder for a few seconds.
    let patience = Instant::now() + Duration::from_secs(60);
    let message = loop {
        let sent = client
            .send_request(
                Subjects::new(run_id).supervisor_scale(),
                async_nats::Request::new()
                    .payload(relay_proto::encode(&req).into())
                    .timeout(Some(DRAIN_GRACE + START_TIMEOUT + Duration::from_secs(15))),
            )
            .await;
        match sent {
            Err(e)
                if e.kind() == async_nats::client::RequestErrorKind::NoResponders
                    && Instant::now() < patience =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => {
                break other.with_context(|| {
                    format!(
                        "no answer from the supervisor of run {run_id} (is `relay up` running?)"
                    )
                })?
            }
        }
    };
    let reply: ScaleReply = relay_proto::decode(&message.payload)
        .map_err(|e| anyhow::anyhow!("bad reply from the supervisor: {e}"))?;
    if let Some(error) = reply.error {
        bail!("scale {service}={copies} refused: {error}");
    }
    Ok(reply)
}

/// `relay scale`.
pub fn scale(args: ScaleArgs) -> Result<()> {
    let targets: Vec<(String, u32)> = args
        .targets
        .iter()
        .map(|t| parse_target(t))
        .collect::<Result<_>>()?;
    let record = read_record(&args.state_dir)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = async_nats::connect(&record.nats_url)
            .await
            .with_context(|| format!("connecting to {}", record.nats_url))?;
        for (service, copies) in targets {
            let reply = request(&client, &record.run_id, &service, copies).await?;
            println!(
                "relay: {service}: {} copies: {}",
                reply.copies,
                reply.instances.join(" ")
            );
            for s in &reply.started {
                println!("relay: started {s}");
            }
            for s in &reply.stopped {
                match s.exit_code {
                    Some(code) => println!("relay: stopped {} (exit code {code})", s.instance),
                    None => println!("relay: stopped {} (killed)", s.instance),
                }
            }
        }
        Ok(())
    })
}

fn refused(req: &ScaleRequest, stack: &Stack, error: String) -> ScaleReply {
    let instances = stack.copies_of(&req.service);
    ScaleReply {
        schema: SCHEMA_VERSION,
        service: req.service.clone(),
        copies: instances.len() as u32,
        instances,
        started: Vec::new(),
        stopped: Vec::new(),
        error: Some(error),
    }
}

/// Waits for removed copies to exit: SIGTERM was sent, SIGKILL after
/// `grace`; each copy's process group (its Python env workers) goes with it.
async fn drain(procs: Vec<Proc>, grace: Duration) -> Vec<StoppedCopy> {
    let deadline = Instant::now() + grace;
    let mut stopped = Vec::new();
    for mut p in procs {
        while !has_exited(&p.child) {
            if Instant::now() > deadline {
                eprintln!(
                    "relay: {} did not stop within {grace:?}; killing it",
                    p.name
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let status = kill_group(&mut p.child);
        stopped.push(StoppedCopy {
            instance: p.name,
            exit_code: status.and_then(|s| s.code()),
        });
    }
    stopped
}

/// The supervisor's side: start or stop copies of `req.service` until
/// `req.copies` run. Answers once new copies are healthy and removed ones
/// have exited.
pub async fn handle(stack: &mut Stack, req: ScaleRequest) -> ScaleReply {
    if let Err(e) = check(&req.service, req.copies) {
        return refused(&req, stack, e);
    }
    let have = stack.copies_of(&req.service).len();
    let want = req.copies as usize;
    let mut started = Vec::new();
    let mut stopped = Vec::new();
    let mut error = None;
    if want > have {
        for _ in have..want {
            match stack.spawn_copy(&req.service) {
                Ok(name) => started.push(name),
                Err(e) => {
                    error = Some(format!("starting a copy of {}: {e:#}", req.service));
                    break;
                }
            }
        }
        // New copies join the queue groups on their own; report them healthy.
        let deadline = Instant::now() + START_TIMEOUT;
        'wait: for p in stack
            .services
            .iter_mut()
            .filter(|p| started.contains(&p.name))
        {
            loop {
                match p.poll_start() {
                    Ok(StartState::Healthy) => break,
                    Ok(StartState::Exited(status)) => {
                        error = Some(format!(
                            "{} exited with {status} during start-up; see its log",
                            p.name
                        ));
                        break 'wait;
                    }
                    Err(e) => {
                        error = Some(format!("{}: {e:#}", p.name));
                        break 'wait;
                    }
                    Ok(StartState::Starting) if Instant::now() > deadline => {
                        error = Some(format!("{} not healthy within {START_TIMEOUT:?}", p.name));
                        break 'wait;
                    }
                    Ok(StartState::Starting) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        if let Err(e) = stack.services_listed() {
            error.get_or_insert(format!("{e:#}"));
        }
    } else if want < have {
        match stack.take_copies(&req.service, have - want) {
            Ok(procs) => stopped = drain(procs, DRAIN_GRACE).await,
            Err(e) => error = Some(format!("{e:#}")),
        }
    }
    let instances = stack.copies_of(&req.service);
    ScaleReply {
        schema: SCHEMA_VERSION,
        service: req.service,
        copies: instances.len() as u32,
        instances,
        started,
        stopped,
        error,
    }
}
