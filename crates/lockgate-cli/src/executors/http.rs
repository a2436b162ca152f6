//! The HTTP executor: POSTs the job's arguments as JSON; any 2xx response succeeds, anything
//! else fails the attempt with the status and the start of the body (no more of it is read).
//! Job identity travels in headers so the endpoint can deduplicate (`Lockgate-Job-Id`,
//! `Lockgate-Attempt`).
//!
//! Every request has a deadline: the executor's `timeout` (`http = { url = "…", timeout = "10s" }`)
//! if configured, else [`DEFAULT_HTTP_TIMEOUT`]; an endpoint that does not answer in time fails
//! the attempt. A cancelled attempt (shutdown, lost lease, the job type's own `timeout`) drops
//! its request at once.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use lockgate::{JobContext, JobError, RawHandler};
use serde_json::Value;

/// Error messages keep the first 1 KiB of a failing response body.
const BODY_HEAD: usize = 1024;

/// A request without an answer after 30 s is failed: long enough for a slow endpoint's real
/// work, short enough that a hanging one does not hold a pool slot (and stretch shutdown) for
/// minutes. The executor's `timeout` replaces it.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// The executor's URL, if it is one this build can call.
pub fn parse_url(url: &str) -> anyhow::Result<reqwest::Url> {
    let parsed = reqwest::Url::parse(url)
        .map_err(|e| anyhow::anyhow!("invalid http executor URL {:?}: {e}", redact_text(url)))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        anyhow::bail!("invalid http executor URL {:?}: http:// or https:// only", shown(&parsed));
    }
    Ok(parsed)
}

/// A URL as errors and logs may show it: without its user, password and query (tokens).
fn shown(url: &reqwest::Url) -> String {
    let mut url = url.clone();
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url.set_query(None);
    url.to_string()
}

/// A URL that does not parse, with whatever stands between `//` and `@` (credentials) hidden.
fn redact_text(url: &str) -> String {
    match (url.find("//"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => format!("{}//***{}", &url[..start], &url[at..]),
        _ => url.to_string(),
    }
}

pub struct HttpExecutor {
    url: reqwest::Url,
    timeout: Duration,
    client: reqwest::Client,
}

impl HttpExecutor {
    /// `timeout` is the executor's configured one, if any.
    pub fn new(url: &str, timeout: Option<Duration>) -> anyhow::Result<Self> {
        let timeout = timeout.unwrap_or(DEFAULT_HTTP_TIMEOUT);
        // No redirects: following a 301/302 turns the POST into a GET without the job's body, and
        // the job would count as done though its arguments never arrived. A 3xx fails the attempt.
        let client = reqwest::Client::builder().timeout(timeout).redirect(reqwest::redirect::Policy::none()).build()?;
        Ok(Self { url: parse_url(url)?, timeout, client })
    }

    async fn run(&self, ctx: JobContext, args: Value) -> Result<(), JobError> {
        let request = self
            .client
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("lockgate-job-id", ctx.job_id.to_string())
            .header("lockgate-job-type", &ctx.job_type)
            .header("lockgate-attempt", ctx.attempt.to_string())
            .body(args.to_string())
            .send();
        let response = tokio::select! {
            response = request => response,
            () = ctx.cancelled() => {
                let reason = ctx.cancel_reason().map_or_else(|| "cancelled".to_string(), |r| r.to_string());
                return Err(JobError::new(format!("request cancelled ({reason})")));
            }
        };
        let response = match response {
            Ok(response) => response,
            Err(e) if e.is_timeout() => {
                let within = humantime::format_duration(self.timeout);
                return Err(JobError::new(format!("no response from {} within {within}", shown(&self.url))));
            }
            // reqwest's message names the URL with its query: ours names it without.
            Err(e) => {
                let cause = JobError::from(e.without_url());
                return Err(JobError::new(format!("request to {} failed: {}", shown(&self.url), cause.message())));
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let redirect = status.is_redirection().then(|| {
            let location =
                response.headers().get(reqwest::header::LOCATION).map(|l| String::from_utf8_lossy(l.as_bytes()));
            format!(
                " (redirects are not followed; location: {})",
                crate::table::shown(location.as_deref().unwrap_or("none"))
            )
        });
        // Read under the attempt's cancellation too: a slow body must not hold a cancelled
        // attempt past it (review helper-122 F2).
        let (head, cut) = tokio::select! {
            read = body_head(response) => read,
            () = ctx.cancelled() => (String::new(), Some("the attempt was cancelled while it was read".to_string())),
        };
        let cut = cut.map(|why| format!(" (the body was cut short: {why})")).unwrap_or_default();
        Err(JobError::new(format!("HTTP {status}{}: {head}{cut}", redirect.unwrap_or_default())))
    }
}

/// The first `BODY_HEAD` characters of a failing response's body, reading no more of it than they
/// can take (4 bytes a character): the whole body was read to keep its start, and a large or
/// endless error page took the process's memory with it (review helper-121 F2). With why the
/// body ended early, if it did (the connection closed mid-body, or the request's deadline passed).
async fn body_head(mut response: reqwest::Response) -> (String, Option<String>) {
    let most = BODY_HEAD * 4;
    let mut bytes = Vec::new();
    let mut cut = None;
    while bytes.len() < most {
        match response.chunk().await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk[..chunk.len().min(most - bytes.len())]),
            Ok(None) => break,
            Err(e) if e.is_timeout() => {
                cut = Some("no more of it came before the request's deadline".to_string());
                break;
            }
            Err(e) => {
                cut = Some(JobError::from(e.without_url()).message().to_string());
                break;
            }
        }
    }
    (String::from_utf8_lossy(&bytes).chars().take(BODY_HEAD).collect(), cut)
}

impl RawHandler for HttpExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_time_out_after_30s_unless_the_executor_has_a_timeout() {
        let default = HttpExecutor::new("http://127.0.0.1:1/", None).unwrap();
        assert_eq!(default.timeout, Duration::from_secs(30));
        let own = HttpExecutor::new("http://127.0.0.1:1/", Some(Duration::from_secs(2))).unwrap();
        assert_eq!(own.timeout, Duration::from_secs(2));
        assert!(parse_url("ftp://h/").is_err() && parse_url("not a url").is_err());
    }
}
