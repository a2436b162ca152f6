//! The HTTP executor: POSTs the job's arguments as JSON; any 2xx response succeeds, anything
//! else fails the attempt with the status and the start of the body. Job identity travels in
//! headers so the endpoint can deduplicate (`Lockgate-Job-Id`, `Lockgate-Attempt`).

use std::future::Future;
use std::pin::Pin;

use lockgate::{JobContext, JobError, RawHandler};
use serde_json::Value;

/// Error messages keep the first 1 KiB of a failing response body.
const BODY_HEAD: usize = 1024;

pub struct HttpExecutor {
    url: reqwest::Url,
    client: reqwest::Client,
}

impl HttpExecutor {
    pub fn new(url: String) -> anyhow::Result<Self> {
        let parsed =
            reqwest::Url::parse(&url).map_err(|e| anyhow::anyhow!("invalid http executor URL {url:?}: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            anyhow::bail!("invalid http executor URL {url:?}: http:// or https:// only");
        }
        Ok(Self { url: parsed, client: reqwest::Client::new() })
    }

    async fn run(&self, ctx: JobContext, args: Value) -> Result<(), JobError> {
        let response = self
            .client
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("lockgate-job-id", ctx.job_id.to_string())
            .header("lockgate-job-type", &ctx.job_type)
            .header("lockgate-attempt", ctx.attempt.to_string())
            .body(args.to_string())
            .send()
            .await?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        let head: String = body.chars().take(BODY_HEAD).collect();
        Err(JobError::new(format!("HTTP {status}: {head}")))
    }
}

impl RawHandler for HttpExecutor {
    fn call(&self, ctx: JobContext, args: Value) -> Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + '_>> {
        Box::pin(self.run(ctx, args))
    }
}
