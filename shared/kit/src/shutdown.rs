//! The shutdown signal passed into every service's `run`.
//!
//! A [`Shutdown`] is a cheap clone of a watch channel; tests trigger it
//! directly, binaries from SIGINT/SIGTERM with [`Shutdown::on_signals`].

use tokio::sync::watch;

/// Fires once; every clone sees it.
#[derive(Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// The sending half of a [`Shutdown`].
#[derive(Clone)]
pub struct ShutdownTrigger {
    tx: std::sync::Arc<watch::Sender<bool>>,
}

impl ShutdownTrigger {
    pub fn trigger(&self) {
        let _ = self.tx.send(true);
    }
}

impl Shutdown {
    pub fn new() -> (ShutdownTrigger, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (
            ShutdownTrigger {
                tx: std::sync::Arc::new(tx),
            },
            Shutdown { rx },
        )
    }

    /// A signal fired by the first SIGINT or SIGTERM.
    pub fn on_signals() -> Shutdown {
        let (trigger, shutdown) = Shutdown::new();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutdown signal received; draining");
            trigger.trigger();
        });
        shutdown
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the signal fires (at once if it already has).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|&fired| fired).await;
    }

    /// Runs `stop` once the signal fires: how blocking work that cannot
    /// await the signal (a wait on a Python worker, an evaluation on a
    /// blocking thread) is told to end.
    pub fn on_trigger(&self, stop: impl FnOnce() + Send + 'static) {
        let shutdown = self.clone();
        tokio::spawn(async move {
            shutdown.wait().await;
            stop();
        });
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
