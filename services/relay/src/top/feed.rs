//! Where `relay top` hears from: the processes of a recorded stack (health
//! probes) and the run's NATS subjects ([`Feed`]).

use super::*;

/// The service a process of the stack record is a copy of: its name without
/// the `-<n>` copy suffix.
pub fn service_of(process: &str) -> &str {
    match process.rsplit_once('-') {
        Some((service, n))
            if !service.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) =>
        {
            service
        }
        _ => process,
    }
}

/// Reads `<state_dir>/stack.json`; `Ok(None)` when there is none.
pub fn read_stack_record(state_dir: &Path) -> Result<Option<StackRecord>> {
    let path = state_dir.join("stack.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("reading {}", path.display()))
}

/// Probes `/healthz` of every service process of a stack record (the
/// infrastructure, which has no metrics address, is left out). Blocking.
pub fn probe_stack(record: &StackRecord) -> Vec<ProcessHealth> {
    record
        .processes
        .iter()
        .filter_map(|p| {
            let addr: SocketAddr = p.metrics_addr.as_deref()?.parse().ok()?;
            let health = match http_status(addr, "/healthz") {
                Some(200) => Health::Up,
                Some(code) => Health::Unhealthy(code),
                None => Health::Down,
            };
            Some(ProcessHealth {
                name: p.name.clone(),
                service: service_of(&p.name).to_string(),
                health,
            })
        })
        .collect()
}

/// Probes the stack recorded in `state_dir` when it runs `run_id`; `None`
/// when there is no (readable) record of that run. Blocking.
pub fn probe_state_dir(state_dir: &Path, run_id: &str) -> Option<Vec<ProcessHealth>> {
    let record = read_stack_record(state_dir).ok().flatten()?;
    (record.run_id == run_id).then(|| probe_stack(&record))
}

/// The subscriptions of one run, merged; feeds a [`TopState`].
pub struct Feed {
    pub(crate) messages: SelectAll<BoxStream<'static, (Topic, async_nats::Message)>>,
}

impl Feed {
    /// Subscribes to the run's `metrics`, `eval`, `status` and `alerts`.
    pub async fn subscribe(client: &async_nats::Client, run_id: &str) -> Result<Self> {
        relay_proto::validate_run_id(run_id).map_err(anyhow::Error::msg)?;
        let subjects = Subjects::new(run_id);
        let mut messages = SelectAll::new();
        for (topic, subject) in [
            (Topic::Metrics, subjects.metrics()),
            (Topic::Eval, subjects.eval()),
            (Topic::Status, subjects.status()),
            (Topic::Alerts, subjects.alerts()),
        ] {
            let subscriber = client
                .subscribe(subject.clone())
                .await
                .with_context(|| format!("subscribing to {subject}"))?;
            messages.push(subscriber.map(move |m| (topic, m)).boxed());
        }
        client.flush().await.context("flushing subscriptions")?;
        Ok(Self { messages })
    }

    /// Waits for the next message and applies it to `state` (one that does
    /// not decode is ignored). Cancel-safe. Returns false once the
    /// subscriptions have ended (the client was closed).
    pub async fn next_into(&mut self, state: &mut TopState) -> bool {
        match self.messages.next().await {
            Some((topic, message)) => {
                state.ingest(topic, &message.payload, Instant::now());
                true
            }
            None => false,
        }
    }

    /// Feeds `state` for at most `max`, or until `until(state)` holds after a
    /// message; returns whether it held.
    pub async fn feed_for(
        &mut self,
        state: &mut TopState,
        max: Duration,
        mut until: impl FnMut(&TopState) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + max;
        loop {
            if until(state) {
                return true;
            }
            match tokio::time::timeout_at(deadline, self.next_into(state)).await {
                Ok(true) => {}
                Ok(false) | Err(_) => return until(state),
            }
        }
    }
}
