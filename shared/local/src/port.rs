//! Servers on free loopback ports: finding a port, starting a server on
//! one (again on another when the port was taken before the server bound
//! it) and waiting until a child process listens.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

/// How many ports [`on_free_port`] tries before it gives up.
pub const PORT_ATTEMPTS: usize = 5;

/// A port that was free on 127.0.0.1 a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts a server with `start(port)` on a port that was free a moment
/// ago, retrying on a new port up to [`PORT_ATTEMPTS`] times: another
/// program can take the port between the check and the server's bind.
/// `start` fails when its server does not listen (see [`wait_for_port`]).
pub fn on_free_port<T>(what: &str, mut start: impl FnMut(u16) -> Result<T>) -> Result<(T, u16)> {
    let mut attempt = 1;
    loop {
        let port = free_port()?;
        match start(port) {
            Ok(started) => return Ok((started, port)),
            Err(e) if attempt < PORT_ATTEMPTS => {
                tracing::warn!("{what} on port {port}: {e:#}; trying another port");
                attempt += 1;
            }
            Err(e) => return Err(e.context(format!("{what}: {PORT_ATTEMPTS} ports tried"))),
        }
    }
}

/// How long [`wait_for_port`] waits for a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listen {
    /// Gives up after this long.
    pub within: Duration,
    /// Once the port accepts connections, how long the server must still
    /// be running to count as listening: another program's server on the
    /// same port accepts them too, while ours, unable to bind it, is
    /// exiting. Zero: looked at once, at once.
    pub settle: Duration,
}

/// Waits until `child` listens on 127.0.0.1:`port`. A child that exits
/// first (its port was taken meanwhile), or does not listen within
/// `listen.within`, is killed and reaped, and the error names `what`.
pub fn wait_for_port(child: &mut Child, port: u16, what: &str, listen: Listen) -> Result<()> {
    let deadline = Instant::now() + listen.within;
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let result = loop {
        let listening = TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok();
        if listening && !listen.settle.is_zero() {
            std::thread::sleep(listen.settle);
        }
        match child.try_wait() {
            Ok(Some(status)) if listening => {
                break Err(anyhow!(
                    "{what} exited with {status}; port {port} belongs to another process"
                ))
            }
            Ok(Some(status)) => {
                break Err(anyhow!(
                    "{what} exited with {status} before listening on port {port}"
                ))
            }
            Ok(None) if listening => return Ok(()),
            Ok(None) => {}
            Err(e) => break Err(anyhow!(e).context(format!("waiting for {what}"))),
        }
        if Instant::now() > deadline {
            break Err(anyhow!(
                "{what} did not listen on port {port} within {:?}",
                listen.within
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    result
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use anyhow::bail;

    use super::*;

    const QUICK: Listen = Listen {
        within: Duration::from_secs(5),
        settle: Duration::from_millis(50),
    };

    #[test]
    fn a_server_that_loses_its_port_is_started_on_another() {
        let mut tried = Vec::new();
        let (started, port) = on_free_port("server", |port| {
            tried.push(port);
            if tried.len() < 3 {
                bail!("port {port} taken");
            }
            Ok(port)
        })
        .unwrap();
        assert_eq!((tried.len(), started), (3, port));
    }

    #[test]
    fn a_server_that_never_starts_is_an_error_naming_it() {
        let e = on_free_port::<()>("nats-server", |port| bail!("port {port} taken")).unwrap_err();
        assert!(
            format!("{e:#}").contains("nats-server: 5 ports tried"),
            "{e:#}"
        );
    }

    #[test]
    fn a_running_child_on_a_listening_port_is_listening() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        wait_for_port(&mut child, port, "sleep", QUICK).unwrap();
        assert_eq!(child.try_wait().unwrap(), None, "left running");
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_child_that_exits_is_an_error_naming_it() {
        let port = free_port().unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let e = wait_for_port(&mut child, port, "true", QUICK).unwrap_err();
        assert!(
            format!("{e:#}").contains("true exited with exit status: 0 before listening"),
            "{e:#}"
        );

        // Another program's server on the port: ours exits meanwhile.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut child = Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let e = wait_for_port(&mut child, port, "true", QUICK).unwrap_err();
        assert!(
            format!("{e:#}").contains("belongs to another process"),
            "{e:#}"
        );
    }

    #[test]
    fn a_child_that_never_listens_is_killed() {
        let port = free_port().unwrap();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let listen = Listen {
            within: Duration::from_millis(200),
            settle: Duration::ZERO,
        };
        let e = wait_for_port(&mut child, port, "sleep", listen).unwrap_err();
        assert!(format!("{e:#}").contains("did not listen"), "{e:#}");
        assert!(child.try_wait().unwrap().is_some(), "killed and reaped");
    }
}
