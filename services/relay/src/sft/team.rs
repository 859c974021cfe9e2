//! This process's place among the replicas of one training ([`Team`]):
//! alone, joined to a group over `--nats`, or rank 0 of replicas it
//! started on this machine with their nats-server.

use anyhow::{bail, Context, Result};
use relay_replicas::Replicas;

use super::args::ReplicaArgs;

/// This process's place among the replicas of one training, and what it
/// started for them: on one machine without `--nats`, the nats-server and
/// the other replicas (rank 0 is this process, which joins first).
pub(super) struct Team {
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) replicas: Replicas,
    pub(super) shutdown: relay_kit::Shutdown,
    /// Keeps `shutdown` from firing.
    _trigger: relay_kit::ShutdownTrigger,
    /// The group and NATS, for the heading.
    joined: Option<(String, String)>,
    /// The other replicas this process started, then the nats-server they
    /// share (dropped in that order).
    children: Vec<std::process::Child>,
    _nats: Option<crate::stack::LocalNats>,
}

impl Team {
    /// Joins the group (`--replicas` above 1 or `--nats`), starting the
    /// nats-server and the other replicas on this machine without
    /// `--nats`; or trains alone.
    pub(super) fn start(args: &ReplicaArgs) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (trigger, shutdown) = relay_kit::Shutdown::new();
        let member = format!(
            "sft-{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        let mut team = Self {
            replicas: Replicas::single(member.clone()),
            runtime,
            shutdown,
            _trigger: trigger,
            joined: None,
            children: Vec::new(),
            _nats: None,
        };
        if args.replicas == 1 && args.nats.is_none() {
            return Ok(team);
        }
        let (nats_url, local) = match &args.nats {
            Some(url) => (url.clone(), false),
            None => {
                let nats = crate::stack::LocalNats::start(
                    &std::env::temp_dir().join(format!("relay-sft-{}", std::process::id())),
                    &args.group,
                )?;
                let url = nats.url.clone();
                team._nats = Some(nats);
                (url, true)
            }
        };
        let nats = team
            .runtime
            .block_on(async_nats::connect(&nats_url))
            .with_context(|| format!("--nats {nats_url}"))?;
        if !nats.server_info().jetstream {
            bail!("--nats {nats_url} has no JetStream, through which the replicas agree (start nats-server with -js)");
        }
        let listen = match &args.listen {
            Some(listen) => listen
                .parse()
                .with_context(|| format!("--listen {listen:?}: an address such as 10.0.0.5:0"))?,
            None => {
                let mut listen = relay_kit::weights::listen_address(
                    &relay_config::WeightsSection::default(),
                    &nats_url,
                )?;
                listen.set_port(0);
                listen
            }
        };
        let config = relay_kit::collective::GroupConfig::new(&args.group, member, listen);
        team.replicas = team.runtime.block_on(Replicas::join_group(&nats, config))?;
        if local {
            // Every other replica is this command again, joined to this NATS.
            let mut own: Vec<String> = std::env::args().skip(1).collect();
            if own.first().map(String::as_str) != Some("sft") {
                bail!("--replicas without --nats starts `relay sft` again for each replica; from a library, give --nats");
            }
            own.extend(["--nats".into(), nats_url.clone()]);
            for _ in 1..args.replicas {
                team.children.push(
                    std::process::Command::new(std::env::current_exe()?)
                        .args(&own)
                        .stdout(std::process::Stdio::null())
                        .spawn()
                        .context("starting a replica")?,
                );
            }
        }
        team.joined = Some((args.group.clone(), nats_url));
        Ok(team)
    }

    /// Waits until `--replicas` replicas have joined.
    pub(super) fn wait_for_all(&mut self, args: &ReplicaArgs) -> Result<()> {
        let Some((group, url)) = &self.joined else {
            return Ok(());
        };
        let within = std::time::Duration::from_secs(args.join_timeout);
        self.runtime
            .block_on(
                self.replicas
                    .wait_for(args.replicas, within, &self.shutdown),
            )
            .with_context(|| format!("group {group} at {url}"))
    }

    /// Whether this process is rank 0: it evaluates, prints and writes.
    pub(super) fn leads(&self) -> bool {
        self.replicas.leads()
    }

    /// The heading's words on the replicas.
    pub(super) fn describe(&self) -> String {
        match &self.joined {
            Some((group, url)) => format!(
                " as {} data-parallel replicas (group {group} at {url})",
                self.replicas.share().1
            ),
            None => String::new(),
        }
    }

    /// Leaves the group and waits for the replicas this process started
    /// (rank 0 told them to stop), saying which failed.
    pub(super) fn finish(&mut self) {
        let replicas = std::mem::replace(&mut self.replicas, Replicas::single(String::new()));
        self.runtime.block_on(replicas.leave());
        for child in &mut self.children {
            match child.wait() {
                Ok(status) if status.success() => {}
                Ok(status) => eprintln!("relay sft: a replica exited with {status}"),
                Err(e) => eprintln!("relay sft: waiting for a replica: {e}"),
            }
        }
        self.children.clear();
    }
}

impl Drop for Team {
    /// A failure of this process ends the replicas it started.
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// This machine's name, for replica ids.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into())
}
