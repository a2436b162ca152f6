//! The HTTP executor over TLS (issue 13): `lockgate run` POSTs a job to an `https://` endpoint
//! this test serves with a certificate of a CA it generates, trusting that CA through
//! `SSL_CERT_FILE` (the system's roots, as an operator would add a corporate CA); with another CA
//! trusted instead, the call is refused and the job dead-lettered with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{lockgate, output, signal, text, wait_exit, DEFAULT_RUNTIME, WAIT};
use lockgate_testkit::{wait_for_count, TestDb};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params
}

/// Serves HTTPS on a free port with a certificate for localhost signed by a new CA, answering
/// every request 200; returns the port, the CA's PEM, and the count of requests answered.
async fn serve_https() -> (u16, String, Arc<AtomicUsize>) {
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params("lockgate https test CA").self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()))
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let answered = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&answered);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, count) = (acceptor.clone(), Arc::clone(&count));
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake: nothing to answer.
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Read the head, then as much body as its content-length says.
                while let Ok(n) = tls.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string())
                            })
                            .and_then(|v| v.parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = tls.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (port, ca.pem(), answered)
}

/// A config whose one job type POSTs to `url`, once (no retries).
fn config(dir: &Path, url: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("lockgate.toml");
    let text = format!(
        "[runtime]\n{DEFAULT_RUNTIME}\n\n[[pool]]\nqueues = [\"default\"]\nconcurrency = 1\n\n\
         [job_types.hook]\nhttp = {url:?}\nmax_attempts = 1\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn run(db: &TestDb, config: &Path, trusted: &Path) -> Child {
    lockgate(db, &["run", "--config", config.to_str().unwrap()])
        .env("SSL_CERT_FILE", trusted)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn stop(mut child: Child) {
    signal(&child, "TERM");
    assert!(wait_exit(&mut child).await.success());
}

#[tokio::test]
async fn the_http_executor_calls_https_trusting_the_systems_roots_and_refuses_an_unknown_issuer() {
    let db = TestDb::migrated().await.unwrap();
    let (port, ca_pem, answered) = serve_https().await;
    let dir = std::env::temp_dir().join(format!("lockgate-https-{}-{:08x}", std::process::id(), fastrand::u32(..)));
    let config = config(&dir, &format!("https://localhost:{port}/hook"));
    std::fs::write(dir.join("ca.crt"), ca_pem).unwrap();
    let other_key = KeyPair::generate().unwrap();
    std::fs::write(dir.join("other-ca.crt"), ca_params("another CA").self_signed(&other_key).unwrap().pem()).unwrap();

    let child = run(&db, &config, &dir.join("ca.crt"));
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.processes WHERE kind = 'supervisor'", 1, WAIT)
        .await
        .unwrap();
    let o = output(&db, &["enqueue", "hook", "{\"n\": 1}"]);
    assert!(o.status.success(), "{}", text(&o));
    wait_for_count(&db.pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await.unwrap();
    assert_eq!(answered.load(Ordering::SeqCst), 1, "the endpoint was called once, over TLS");
    stop(child).await;

    let child = run(&db, &config, &dir.join("other-ca.crt"));
    let o = output(&db, &["enqueue", "hook", "{\"n\": 2}"]);
    assert!(o.status.success(), "{}", text(&o));
    wait_for_count(&db.pool, "SELECT count(*) FROM lockgate.dead_letters", 1, WAIT).await.unwrap();
    stop(child).await;
    let error: String =
        sqlx::query_scalar("SELECT error FROM lockgate.dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(error.to_lowercase().contains("certificate"), "refused for its certificate: {error}");
    assert_eq!(answered.load(Ordering::SeqCst), 1, "nothing was sent to an endpoint it could not verify");
    std::fs::remove_dir_all(&dir).ok();
}

/// The URL's TLS files: a missing one is named before any connect; `sslmode=require` with a root
/// certificate verifies the server against it, as libpq does (the server's own certificate was not
/// signed by this CA, so the connection is refused).
#[tokio::test]
async fn tls_files_in_the_url_are_checked_and_require_with_a_root_certificate_verifies() {
    let db = TestDb::migrated().await.unwrap();
    let (base, _) = db.url.split_once('?').unwrap();
    let missing = format!("{base}?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem");
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &missing).output().unwrap();
    assert!(
        !o.status.success() && text(&o).contains("sslrootcert \"/nonexistent/ca.pem\" is not a readable file"),
        "{}",
        text(&o)
    );

    let dir = std::env::temp_dir().join(format!("lockgate-ca-{}-{:08x}", std::process::id(), fastrand::u32(..)));
    std::fs::create_dir_all(&dir).unwrap();
    let key = KeyPair::generate().unwrap();
    std::fs::write(dir.join("ca.crt"), ca_params("a CA that signed nothing").self_signed(&key).unwrap().pem()).unwrap();
    let ssl_on: String = sqlx::query_scalar("SHOW ssl").fetch_one(&db.pool).await.unwrap();
    let require = format!("{base}?sslmode=require&sslrootcert={}", dir.join("ca.crt").display());
    let o = lockgate(&db, &["status"]).env("DATABASE_URL", &require).output().unwrap();
    let expected = if ssl_on == "on" { "certificate" } else { "TLS" };
    assert!(!o.status.success() && text(&o).contains(expected), "{}", text(&o));
    std::fs::remove_dir_all(&dir).ok();
}
