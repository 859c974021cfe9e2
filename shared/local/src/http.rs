//! The one HTTP client of the workspace: a blocking GET on a loopback (or
//! any plain-HTTP) address, for a service's `/healthz` and `/metrics` and
//! Prometheus' API. [`ureq`] speaks the protocol; this module fixes how:
//! explicit timeouts, any status an answer (not an error), no proxy from
//! the environment, no TLS, no connection kept between calls.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};

/// The time limits of one GET.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// To connect.
    pub connect: Duration,
    /// To receive the response's head, and then again its whole body.
    pub read: Duration,
}

fn agent(timeouts: Timeouts) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_connect(Some(timeouts.connect))
        .timeout_recv_response(Some(timeouts.read))
        .timeout_recv_body(Some(timeouts.read))
        // A 503 from a starting service is an answer.
        .http_status_as_error(false)
        // Loopback: never through an HTTP_PROXY the environment names.
        .proxy(None)
        .max_idle_connections(0)
        .build()
        .into()
}

fn call(
    addr: SocketAddr,
    path: &str,
    timeouts: Timeouts,
) -> Result<ureq::http::Response<ureq::Body>> {
    let url = format!("http://{addr}{path}");
    agent(timeouts)
        .get(&url)
        .call()
        .with_context(|| format!("GET {url}"))
}

/// GETs `path` (with its query, if any) from the HTTP server at `addr`:
/// the status and the body, whatever the status.
pub fn get(addr: SocketAddr, path: &str, timeouts: Timeouts) -> Result<(u16, String)> {
    let mut response = call(addr, path, timeouts)?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_string()
        .with_context(|| format!("GET http://{addr}{path}: reading the body"))?;
    Ok((status, body))
}

/// The status of a GET of `path` from `addr` (a health probe); the body
/// is not read.
pub fn status(addr: SocketAddr, path: &str, timeouts: Timeouts) -> Result<u16> {
    Ok(call(addr, path, timeouts)?.status().as_u16())
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;

    use super::*;

    const QUICK: Timeouts = Timeouts {
        connect: Duration::from_secs(2),
        read: Duration::from_secs(5),
    };

    /// A server that answers one request with `status` and `body`, and
    /// hands back the request line it got.
    fn answer_once(
        status: &'static str,
        body: &'static str,
    ) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut request_line = String::new();
            reader.read_line(&mut request_line).unwrap();
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap() > 2 {
                line.clear();
            }
            write!(
                reader.get_mut(),
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            request_line
        });
        (addr, server)
    }

    #[test]
    fn get_returns_the_status_and_body() {
        let (addr, server) = answer_once("200 OK", "relay_up 1\n");
        let got = get(addr, "/metrics", QUICK).unwrap();
        assert_eq!(got, (200, "relay_up 1\n".to_string()));
        assert_eq!(server.join().unwrap().trim_end(), "GET /metrics HTTP/1.1");
    }

    #[test]
    fn an_error_status_is_an_answer() {
        let (addr, server) = answer_once("503 Service Unavailable", "starting\n");
        assert_eq!(status(addr, "/healthz", QUICK).unwrap(), 503);
        server.join().unwrap();
    }

    #[test]
    fn nothing_listening_is_an_error_naming_the_url() {
        let port = crate::free_port().unwrap();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let e = get(addr, "/healthz", QUICK).unwrap_err();
        assert!(
            format!("{e:#}").contains(&format!("GET http://{addr}/healthz")),
            "{e:#}"
        );
    }

    #[test]
    fn a_silent_server_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let quick = Timeouts {
            connect: Duration::from_millis(300),
            read: Duration::from_millis(200),
        };
        let started = std::time::Instant::now();
        assert!(status(addr, "/healthz", quick).is_err());
        assert!(started.elapsed() < Duration::from_secs(3));
        drop(listener);
    }
}
