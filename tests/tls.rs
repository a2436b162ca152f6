//! TLS to PostgreSQL (issue 13): the server is switched to a certificate this test generates (a
//! CA of its own, a server certificate for 127.0.0.1 and localhost), and lockgate, given
//! `sslmode=verify-full` and `sslrootcert` in its URL, migrates, enqueues and runs a job over an
//! encrypted, verified connection; with another CA it is refused. The server's own certificate is
//! restored at the end (and at the start, should an earlier run have stopped half-way).
//!
//! It changes the shared server's TLS files (ALTER SYSTEM and a reload), which connections that do
//! not verify the server (sslmode prefer, the default) do not notice. It needs a superuser and the
//! server on this host (it hands the key file to the server's user).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{chown, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::{queue, test_config, Counter, Running, WAIT};
use lockgate::{Client, Job, JobContext, JobError, JobPolicy, PgPool, Registry};
use lockgate_testkit::{wait_for, wait_for_count, TestDb};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use serde::{Deserialize, Serialize};

/// A CA's certificate (PEM) and key.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    Ca { cert: params.self_signed(&key).unwrap(), key }
}

/// Writes the server's certificate and key (readable by the server's user only) and both CAs.
fn write_files(dir: &Path, server_ca: &Ca, other_ca: &Ca, owner: (u32, u32)) {
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "lockgate test server");
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &server_ca.cert, &server_ca.key).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("server.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("ca.crt"), server_ca.cert.pem()).unwrap();
    std::fs::write(dir.join("other-ca.crt"), other_ca.cert.pem()).unwrap();
    for file in ["server.crt", "server.key"] {
        chown(dir.join(file), Some(owner.0), Some(owner.1)).expect("chown to the server's user: run as root");
    }
    std::fs::set_permissions(dir.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Points the server at `files` (cert, key), or back at its configured ones (None), and reloads.
async fn use_server_files(admin: &PgPool, files: Option<(&Path, &Path)>) {
    match files {
        Some((cert, key)) => {
            // ALTER SYSTEM takes no parameters; the paths are this test's own, quoted as literals.
            for (setting, path) in [("ssl_cert_file", cert), ("ssl_key_file", key)] {
                let literal: String = sqlx::query_scalar("SELECT quote_literal($1)")
                    .bind(path.to_str().unwrap())
                    .fetch_one(admin)
                    .await
                    .unwrap();
                sqlx::raw_sql(&format!("ALTER SYSTEM SET {setting} = {literal}")).execute(admin).await.unwrap();
            }
        }
        None => {
            for setting in ["ssl_cert_file", "ssl_key_file"] {
                sqlx::raw_sql(&format!("ALTER SYSTEM RESET {setting}")).execute(admin).await.unwrap();
            }
        }
    }
    sqlx::query("SELECT pg_reload_conf()").execute(admin).await.unwrap();
}

/// The test database's URL (whose sslmode, plain TCP for the other tests, is dropped) with
/// verify-full against `root_cert`.
fn with_tls(url: &str, root_cert: &Path) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: Vec<&str> = query.split('&').filter(|p| !p.is_empty() && !p.starts_with("sslmode=")).collect();
    let tls = format!("sslmode=verify-full&sslrootcert={}", root_cert.display());
    params.push(&tls);
    format!("{base}?{}", params.join("&"))
}

#[derive(Serialize, Deserialize)]
struct Hello {
    n: u32,
}

impl Job for Hello {
    const TYPE: &'static str = "hello";
    fn policy() -> JobPolicy {
        JobPolicy::on_queue(queue("default"))
    }
}

/// What running lockgate over TLS must do: connect verified, migrate, enqueue, run a job.
async fn run_over_tls(db: &TestDb, dir: &Path) -> anyhow::Result<()> {
    let url = with_tls(&db.url, &dir.join("ca.crt"));
    // The reload is asynchronous: wait until the server presents the new certificate.
    let last_error = std::sync::Mutex::new(String::new());
    let pool = wait_for("the server to present the test's certificate", WAIT, || async {
        Ok(PgPool::connect(&url).await.map_err(|e| *last_error.lock().unwrap() = format!("{e:#}")).ok())
    })
    .await
    .map_err(|timeout| anyhow::anyhow!("{timeout}; the last connect said: {}", last_error.lock().unwrap()))?;
    let encrypted: bool =
        sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetch_one(&pool).await?;
    anyhow::ensure!(encrypted, "the verified connection is not encrypted");
    lockgate::migrate(&pool).await?;
    let client = Client::new(pool.clone());
    client.define::<Hello>().await?;
    client.enqueue(&Hello { n: 1 }).await?;
    let ran = Counter::default();
    let mut registry = Registry::new();
    let counted = ran.clone();
    registry.register::<Hello, _>(move |_ctx: JobContext, _job: Hello| {
        let counted = counted.clone();
        async move {
            counted.bump();
            Ok::<(), JobError>(())
        }
    })?;
    // The runtime's pool and its heartbeat's own connection both come from the TLS URL.
    let running = Running::start_on(PgPool::connect(&url).await?, test_config(), registry, &["default"], 1);
    wait_for_count(&pool, "SELECT count(*) FROM pgmq.a_default", 1, WAIT).await?;
    running.stop().await;
    anyhow::ensure!(ran.get() == 1, "the job ran {} times", ran.get());
    // Another CA does not vouch for the server: refused.
    let wrong = with_tls(&db.url, &dir.join("other-ca.crt"));
    match PgPool::connect(&wrong).await {
        Ok(_) => anyhow::bail!("a server certificate from another CA was accepted"),
        Err(error) => {
            let text = format!("{error:#}").to_lowercase();
            anyhow::ensure!(text.contains("certificate") || text.contains("issuer"), "refused, but why? {text}");
        }
    }
    Ok(())
}

/// Puts the server back on its own certificate even when the test panics half-way (a blocking
/// psql, since a destructor cannot await). `.ci/run` also drops lines a killed run left behind.
struct RestoreOnDrop(String);

impl Drop for RestoreOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([self.0.as_str(), "-qc", "ALTER SYSTEM RESET ssl_cert_file", "-c", "ALTER SYSTEM RESET ssl_key_file"])
            .args(["-c", "SELECT pg_reload_conf()"])
            .output();
    }
}

#[tokio::test]
async fn verify_full_connects_with_the_servers_ca_and_is_refused_with_another() {
    let db = TestDb::migrated().await.unwrap();
    let admin = db.new_pool(1).await.unwrap();
    // A run that stopped half-way left the server on its files: back to its own first.
    use_server_files(&admin, None).await;
    let data_dir: String = sqlx::query_scalar("SHOW data_directory").fetch_one(&admin).await.unwrap();
    let meta = std::fs::metadata(&data_dir).expect("the server runs on this host");
    let dir = PathBuf::from(format!("/tmp/lockgate-tls-{}-{:08x}", std::process::id(), fastrand::u32(..)));
    let _restore = RestoreOnDrop(db.url.clone());
    write_files(&dir, &ca("lockgate test CA"), &ca("another CA"), (meta.uid(), meta.gid()));
    use_server_files(&admin, Some((&dir.join("server.crt"), &dir.join("server.key")))).await;
    let outcome = run_over_tls(&db, &dir).await;
    use_server_files(&admin, None).await;
    // The directory goes once the server presents its own certificate again.
    let ours = with_tls(&db.url, &dir.join("ca.crt"));
    wait_for("the server to present its own certificate again", WAIT, || async {
        Ok(PgPool::connect(&ours).await.is_err().then_some(()))
    })
    .await
    .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    outcome.unwrap();
}
