//! A minimal HTTP/1.1 server for /metrics and /status: one request per connection,
//! GET or HEAD, answered and closed. It is bounded against a slow or hostile peer:
//! the request head must arrive within READ_DEADLINE and fit in MAX_HEAD_BYTES, the
//! answer must be taken within WRITE_DEADLINE, and at most MAX_CONNECTIONS are served
//! at once (more are closed at accept), so that no peer can hold a scrape up.

use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// The most a request's head (request line and headers) may take: a scrape's is a
/// few hundred bytes.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// How long a peer has to send its request head, from the accept.
pub const READ_DEADLINE: Duration = Duration::from_secs(5);
/// How long a peer has to take the answer.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Connections served at once; another is closed as soon as it is accepted.
pub const MAX_CONNECTIONS: usize = 64;
/// After the answer, what the peer still sends is read and dropped for this long (at
/// most LINGER_BYTES): closed with unread data, the socket would send a reset that
/// can destroy the answer before the peer reads it (a 431 to an oversized head).
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 1 << 20;

/// What the server serves: a page's content type and body by path (None: 404).
pub trait Site: Send + Sync {
    fn page(&self, path: &str) -> Option<(&'static str, String)>;
}

/// An answer, before it is written.
#[derive(Debug, PartialEq, Eq)]
pub struct Response {
    pub code: u16,
    pub content_type: &'static str,
    pub body: String,
    /// HEAD: the headers of the GET, no body.
    pub head_only: bool,
}

impl Response {
    fn plain(code: u16, body: &str) -> Response {
        Response {
            code,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
            head_only: false,
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let reason = match self.code {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            431 => "Request Header Fields Too Large",
            _ => "Error",
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.code,
            self.content_type,
            self.body.len()
        );
        if self.code == 405 {
            out.push_str("Allow: GET, HEAD\r\n");
        }
        out.push_str("\r\n");
        let mut b = out.into_bytes();
        if !self.head_only {
            b.extend_from_slice(self.body.as_bytes());
        }
        b
    }
}

/// How reading a request head ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    Complete(Vec<u8>),
    TooLarge,
    /// The peer closed (or failed) before a whole head.
    Closed,
}

/// The answer to a request head.
pub fn route(head: &[u8], site: &dyn Site) -> Response {
    let text = String::from_utf8_lossy(head);
    let line = text.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Response::plain(400, "bad request line");
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Response::plain(400, "bad request line");
    }
    let path = target.split('?').next().unwrap_or("");
    let Some((content_type, body)) = site.page(path) else {
        return Response::plain(404, "not found: try /metrics or /status");
    };
    match method {
        "GET" | "HEAD" => Response {
            code: 200,
            content_type,
            body,
            head_only: method == "HEAD",
        },
        _ => Response::plain(405, "only GET and HEAD"),
    }
}

/// Reads up to the blank line ending the head, never more than MAX_HEAD_BYTES.
async fn read_head(s: &mut TcpStream) -> Head {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return Head::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(end);
            return Head::Complete(buf);
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Head::TooLarge;
        }
    }
}

async fn handle(mut s: TcpStream, site: Arc<dyn Site>) {
    let resp = match tokio::time::timeout(READ_DEADLINE, read_head(&mut s)).await {
        Err(_) => Response::plain(408, "the request took too long"),
        Ok(Head::TooLarge) => Response::plain(431, "request head too large"),
        Ok(Head::Closed) => return,
        Ok(Head::Complete(h)) => route(&h, site.as_ref()),
    };
    let write = async {
        s.write_all(&resp.bytes()).await?;
        s.shutdown().await
    };
    // A peer that does not take the answer is dropped at the deadline.
    if let Ok(Ok(())) = tokio::time::timeout(WRITE_DEADLINE, write).await {
        let _ = tokio::time::timeout(LINGER, drain(&mut s)).await;
    }
}

/// Reads and drops what the peer sends until it closes (at most LINGER_BYTES).
async fn drain(s: &mut TcpStream) {
    let mut chunk = [0u8; 4096];
    let mut left = LINGER_BYTES;
    while left > 0 {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// Serves until `stop` turns true.
pub async fn serve(listener: TcpListener, site: Arc<dyn Site>, mut stop: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        tokio::select! {
            r = listener.accept() => {
                let Ok((s, _)) = r else {
                    // Out of descriptors, most likely: wait rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        let site = site.clone();
                        tokio::spawn(async move {
                            handle(s, site).await;
                            drop(slot);
                        });
                    }
                    // Over the limit: closed now, so that the held ones cannot
                    // queue a scrape behind them.
                    Err(_) => drop(s),
                }
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct One;
    impl Site for One {
        fn page(&self, path: &str) -> Option<(&'static str, String)> {
            (path == "/metrics").then(|| ("text/plain", "m 1".to_string()))
        }
    }

    #[test]
    fn routes() {
        let r = route(b"GET /metrics HTTP/1.1\r\nHost: x", &One);
        assert_eq!((r.code, r.body.as_str()), (200, "m 1"));
        let r = route(b"GET /metrics?x=1 HTTP/1.0", &One);
        assert_eq!(r.code, 200);
        let r = route(b"HEAD /metrics HTTP/1.1", &One);
        assert!(r.head_only);
        let text = String::from_utf8(r.bytes()).unwrap();
        assert!(text.contains("Content-Length: 3\r\n") && text.ends_with("\r\n\r\n"));
        assert_eq!(route(b"GET /nope HTTP/1.1", &One).code, 404);
        assert_eq!(route(b"POST /metrics HTTP/1.1", &One).code, 405);
        assert_eq!(route(b"GET /metrics", &One).code, 400);
        assert_eq!(route(b"\x00\xff", &One).code, 400);
    }
}
