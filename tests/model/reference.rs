//! The reference model: what a correct permit protocol must look like from the outside. It holds
//! every job ever committed and where it must be, every delivery a claim handed out and whether
//! its holder still believes it runs the job, and the limits in force. After every step it is
//! compared with the database (`Model::check`).

use std::collections::{BTreeMap, BTreeSet};

use super::db::State;
use super::ops::{Queue, Ty, SHARED_K, SHARED_KEY};

/// Where a committed job must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// In its queue table or parked (which of the two is the protocol's business).
    Live,
    Archived,
    DeadLettered,
    /// Archived by `lockgate.cancel`; counted as failed in its batch.
    Cancelled,
    /// Deleted for good by `lockgate.discard_job` (dead or parked); counted as failed in its batch.
    Discarded,
}

/// What the holder of a delivery believes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Runs the job: claimed, not finished, never told it lost it, budget not run out. A
    /// cancel does not stop it: its handler runs on until a heartbeat reports the delivery lost
    /// (then it is `Fenced`), its budget runs out, or it finishes.
    Running,
    /// Stopped without finishing: told it lost the delivery, or its budget ran out (a worker
    /// cancels its handler before then, H27).
    Fenced(String),
    /// Finished it (complete, retry, release or dead-letter), whatever the database answered.
    Finished(String),
}

#[derive(Clone, Debug)]
pub struct Delivery {
    pub id: usize,
    pub worker: usize,
    pub queue: Queue,
    pub msg_id: i64,
    pub read_ct: i32,
    pub job_id: i64,
    pub ty: Option<Ty>,
    pub key: Option<String>,
    /// Its type was limited when it was claimed: it must run holding a permit.
    pub limited: bool,
    /// The while_executing key it was delivered with: it runs holding that key's lock.
    pub wkey: Option<String>,
    pub holder: Holder,
    /// Its job was cancelled while this delivery was the one running it: the cancel kept what it
    /// holds (its permit) for its handler, and `lockgate.release_cancelled` with its token gives
    /// that back once the handler has ended.
    pub cancelled: bool,
    /// Told of its cancel by a heartbeat, its handler did not stop (it blocks its thread): it
    /// runs on, and its heartbeats renew what the cancel kept (`lockgate.extend_cancelled`) until
    /// the handler ends (design §95).
    pub blocked: bool,
}

impl Delivery {
    pub fn token(&self) -> String {
        format!("({}, {}, {})", self.queue.name(), self.msg_id, self.read_ct)
    }
    pub fn describe(&self) -> String {
        format!(
            "delivery d{} {} of job {} key {}{} by worker {} [{:?}{}]",
            self.id,
            self.token(),
            self.job_id,
            self.key.as_deref().unwrap_or("-"),
            self.wkey.as_deref().map(|w| format!(" while_executing {w}")).unwrap_or_default(),
            self.worker,
            self.holder,
            match (self.cancelled, self.blocked) {
                (true, true) => ", its job cancelled, its handler blocking",
                (true, false) => ", its job cancelled",
                _ => "",
            }
        )
    }
}

/// Which checks are enforced (all by default; LOCKGATE_MODEL_CHECKS=a keeps only (a), to show
/// that the over-admission itself is found and not only its precursor).
#[derive(Clone, Debug)]
pub struct Checks(pub String);

impl Checks {
    pub fn on(&self, c: char) -> bool {
        self.0.contains(c)
    }
}

/// A while_executing lock as the model expects it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WLock {
    /// The job whose run took it: a delivery of it was returned, and its run has not ended
    /// (completed, retried, released, dead-lettered, cancelled, parked again). A holder running
    /// out of budget ends nothing by itself: the job's next delivery takes the lock back as its
    /// owner, another job's claim takes it over (design §103), or a sweep gives it back (§108).
    pub job: i64,
    /// The delivery its job was cancelled in, for whose handler the cancel kept it: until
    /// `release_cancelled` with that delivery's token, or until its budget has passed.
    pub kept: Option<usize>,
    /// The kept lock's held_until has passed, or the running holder's visibility has: a claim
    /// of its key takes it over.
    pub lapsed: bool,
}

/// What the model expects of the case's batch beyond its counts.
#[derive(Debug, Default)]
pub struct BatchModel {
    /// `lockgate.close_batch` committed: enqueues after it go outside the batch.
    pub closed: bool,
    /// Closed with every job counted while an enqueue still shared the batch row, which then
    /// added nothing (rolled back, or a duplicate): no completion is left to finish it, and only
    /// the batch sweep may.
    pub left_to_sweep: bool,
}

#[derive(Debug, Default)]
pub struct Model {
    pub limits: BTreeMap<Ty, u32>,
    /// Per key, the jobs running on it when the limit of a type running on it was lowered: they
    /// may go on running (nothing preempts them), so the key's bound is the larger of the new
    /// limit and how many of them still run. Any other admission must fit the new limit.
    pub carried: BTreeMap<String, BTreeSet<i64>>,
    pub jobs: BTreeMap<i64, Fate>,
    /// Job ids returned inside transactions that were rolled back: they must never be seen.
    pub rolled_back: BTreeSet<i64>,
    pub deliveries: Vec<Delivery>,
    /// The newest read_ct a claim returned per message.
    pub newest_read: BTreeMap<(Queue, i64), i32>,
    /// Messages this model archived or dead-lettered.
    pub gone: BTreeSet<(Queue, i64)>,
    /// Each worker's registered process id (the claims' owner).
    pub owners: [i64; 2],
    /// Uniqueness locks and batches exist in this database (see db::Api).
    pub bookkeeping: bool,
    /// The unique key of each committed job of a unique type.
    pub unique: BTreeMap<i64, String>,
    /// The case's batch: the committed jobs enqueued into it (while it was open).
    pub batch_jobs: BTreeSet<i64>,
    /// Jobs of the batch retried from the dead letters: counted as failed for good, whatever
    /// becomes of them after.
    pub retried_out: BTreeSet<i64>,
    pub batch: BatchModel,
    /// The while_executing locks, by key.
    pub wlocks: BTreeMap<String, WLock>,
    /// A limit was changed since the last sweep: a raised one lets parked jobs through only at
    /// the next sweep, enqueue or completion of their key (README), so (m) waits for a sweep.
    pub limits_changed: bool,
    /// Keys that held permits when a limit was lowered (or set again after it was removed): their
    /// holders may keep permits past the new limit (a waiting one until its claim re-admits it,
    /// design §80), so (a)'s count of permits leaves them out for the rest of the case.
    pub lowered_on: BTreeSet<String>,
}

impl Model {
    /// Every job enqueued into the batch has a fate: none is live.
    pub fn batch_counted(&self) -> bool {
        self.batch_jobs.iter().all(|j| self.retried_out.contains(j) || self.jobs.get(j) != Some(&Fate::Live))
    }

    /// The state the case's batch must be in.
    pub fn batch_state(&self) -> &'static str {
        if !self.batch.closed {
            "open"
        } else if self.batch_counted() && !self.batch.left_to_sweep {
            "finished"
        } else {
            "closed"
        }
    }

    /// Indices of running deliveries, in claim order.
    pub fn running(&self) -> Vec<usize> {
        (0..self.deliveries.len()).filter(|&i| self.deliveries[i].holder == Holder::Running).collect()
    }

    /// Running deliveries whose handler can finish: not one blocking on after its cancel, which
    /// ends only at a heartbeat step without `blocked` (or a clock runs its budget out).
    pub fn finishable(&self) -> Vec<usize> {
        self.running().into_iter().filter(|&i| !self.deliveries[i].blocked).collect()
    }

    /// Indices of deliveries whose holder stopped without finishing, in claim order.
    pub fn fenced(&self) -> Vec<usize> {
        (0..self.deliveries.len()).filter(|&i| matches!(self.deliveries[i].holder, Holder::Fenced(_))).collect()
    }

    /// Indices of deliveries whose token is provably stale: a later claim of the same message was
    /// seen, or the message was archived, dead-lettered or cancelled. Not those whose holder still
    /// runs (a cancelled job's, until it learns): what such a holder does with its token is what
    /// `Extend` and `Finish` model.
    pub fn stale(&self) -> Vec<usize> {
        (0..self.deliveries.len())
            .filter(|&i| {
                let d = &self.deliveries[i];
                d.holder != Holder::Running
                    && (self.gone.contains(&(d.queue, d.msg_id))
                        || self.newest_read.get(&(d.queue, d.msg_id)).is_some_and(|&n| n > d.read_ct))
            })
            .collect()
    }

    /// A clock moved past a row of this message: every holder running it has run out of budget.
    pub fn fence_message(&mut self, queue: Queue, msg_id: i64, why: &str) -> Vec<usize> {
        let mut fenced = Vec::new();
        for d in &mut self.deliveries {
            if d.queue == queue && d.msg_id == msg_id && d.holder == Holder::Running {
                d.holder = Holder::Fenced(why.to_string());
                fenced.push(d.id);
            }
        }
        fenced
    }

    /// A job was cancelled; `running` is the delivery that held it, if it was running. Every
    /// message it was delivered through is gone, but no holder is stopped here: a holder still
    /// running it keeps running (and counting against its key's limit) until a heartbeat reports
    /// its delivery lost, its budget runs out, or it finishes and is refused.
    /// The while_executing lock of a running job is kept for that delivery; any other lock of
    /// the job is released.
    pub fn cancel_job(&mut self, job: i64, running: Option<usize>) {
        self.jobs.insert(job, Fate::Cancelled);
        for d in &mut self.deliveries {
            if d.job_id == job {
                self.gone.insert((d.queue, d.msg_id));
            }
        }
        if let Some(i) = running {
            self.deliveries[i].cancelled = true;
        }
        let kept_key = running.and_then(|i| self.deliveries[i].wkey.clone());
        self.wlocks.retain(|key, l| l.job != job || l.kept.is_some() || Some(key) == kept_key.as_ref());
        if let (Some(key), Some(i)) = (kept_key, running) {
            if let Some(l) = self.wlocks.get_mut(&key).filter(|l| l.job == job) {
                l.kept = Some(i);
            }
        }
    }

    /// A run of `job` ended by a step that took effect (completion, retry, release, dead
    /// letter): its while_executing lock goes.
    pub fn run_ended(&mut self, job: i64) {
        self.wlocks.retain(|_, l| l.job != job || l.kept.is_some());
    }

    /// The claim parked these jobs again: their while_executing locks went.
    pub fn parked_again(&mut self, jobs: &[i64]) {
        self.wlocks.retain(|_, l| !jobs.contains(&l.job) || l.kept.is_some());
    }

    /// A sweep ran: the lock of every run under way whose visibility has passed goes (design
    /// §108; the model runs no `sql` statement that would keep one).
    pub fn swept(&mut self) {
        self.wlocks.retain(|_, l| l.kept.is_some() || !l.lapsed);
    }

    /// The reaper ran: every lock kept for a cancelled handler whose held_until has passed goes.
    pub fn reaped(&mut self) {
        self.wlocks.retain(|_, l| l.kept.is_none() || !l.lapsed);
    }

    /// Delivery i's worker called release_cancelled: the lock kept for it goes. Returns whether
    /// one was there to release.
    pub fn released(&mut self, i: usize) -> bool {
        let before = self.wlocks.len();
        self.wlocks.retain(|_, l| l.kept != Some(i));
        self.wlocks.len() != before
    }

    /// A clock moved past the budget of the deliveries of this message: a lock kept for one of
    /// them is held no longer (its held_until has passed), nor one its job's run took through
    /// this message (its visibility has passed: the heartbeat renews it no more).
    pub fn budget_passed(&mut self, queue: Queue, msg_id: i64) {
        for l in self.wlocks.values_mut() {
            let through_message =
                |i: &usize| self.deliveries[*i].queue == queue && self.deliveries[*i].msg_id == msg_id;
            let lapsed = match l.kept {
                Some(i) => through_message(&i),
                None => (0..self.deliveries.len()).any(|i| {
                    self.deliveries[i].job_id == l.job && self.deliveries[i].wkey.is_some() && through_message(&i)
                }),
            };
            if lapsed {
                l.lapsed = true;
            }
        }
    }

    /// Delivery i was returned by a claim: a while_executing job now holds its key. Returns
    /// what is wrong with that, if its key was not free: held by another job's run, or kept for
    /// a cancelled handler whose budget has not passed.
    pub fn delivered(&mut self, i: usize) -> Option<String> {
        let d = &self.deliveries[i];
        let key = d.wkey.clone()?;
        let problem = match self.wlocks.get(&key) {
            _ if self.live_holder(&key).is_some() => {
                Some(format!("until_executed job {} holds its key", self.live_holder(&key).unwrap_or_default()))
            }
            Some(l) if l.kept.is_some() && !l.lapsed => {
                Some(format!("its lock was kept for the cancelled handler of d{}", l.kept.unwrap_or_default()))
            }
            Some(l) if l.kept.is_none() && !l.lapsed && l.job != d.job_id => {
                Some(format!("job {} holds its lock", l.job))
            }
            _ => None,
        };
        let problem = problem.map(|p| format!("(l) claim delivered {} although {p}", d.describe()));
        self.wlocks.insert(key, WLock { job: d.job_id, kept: None, lapsed: false });
        problem
    }

    /// Messages of cancelled deliveries whose budget (the visibility they had at the cancel) has
    /// not been seen to pass: their holder still runs, or their lock is still kept.
    pub fn cancelled_invisible(&self) -> Vec<(Queue, i64)> {
        let kept: Vec<usize> = self.wlocks.values().filter(|l| !l.lapsed).filter_map(|l| l.kept).collect();
        let mut out: Vec<(Queue, i64)> = self
            .deliveries
            .iter()
            .filter(|d| d.cancelled && (d.holder == Holder::Running || kept.contains(&d.id)))
            .map(|d| (d.queue, d.msg_id))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Records a delivery a claim returned (its `id` and `holder` are set here); returns its id.
    pub fn add_delivery(&mut self, mut d: Delivery, budget: f64) -> usize {
        d.id = self.deliveries.len();
        let newest = self.newest_read.entry((d.queue, d.msg_id)).or_insert(d.read_ct);
        *newest = (*newest).max(d.read_ct);
        d.holder = if budget > 0.0 { Holder::Running } else { Holder::Fenced(format!("claimed with budget {budget}")) };
        d.cancelled = false;
        let id = d.id;
        self.deliveries.push(d);
        id
    }

    /// The until_executed key a job of `ty` with argument `k` takes, if its type is `uniq`.
    pub fn unique_key(&self, ty: Ty, k: u8) -> Option<String> {
        (self.bookkeeping && ty == Ty::Uniq).then(|| {
            if k == SHARED_K {
                SHARED_KEY.to_string()
            } else {
                format!("uniq:[{k}]")
            }
        })
    }

    /// The job whose lock row an until_executed enqueue of `key` meets: a live `uniq` job, or the
    /// job of a while_executing lock, running (even past its visibility: only a claim judges that
    /// lapse, design §105) or kept for a cancelled handler whose held_until has not passed; one
    /// whose held_until has passed the enqueue deletes (`took_key`).
    pub fn key_holder(&self, key: &str) -> Option<i64> {
        self.live_holder(key).or_else(|| self.wlocks.get(key).filter(|l| l.kept.is_none() || !l.lapsed).map(|l| l.job))
    }

    /// An until_executed enqueue took `key`: a while_executing lock of it kept for a cancelled
    /// handler whose held_until had passed is gone.
    pub fn took_key(&mut self, key: &str) {
        if self.wlocks.get(key).is_some_and(|l| l.kept.is_some() && l.lapsed) {
            self.wlocks.remove(key);
        }
    }

    /// The live job holding unique key `key`, if any.
    pub fn live_holder(&self, key: &str) -> Option<i64> {
        self.unique
            .iter()
            .find(|(job, k)| k.as_str() == key && self.jobs.get(job) == Some(&Fate::Live))
            .map(|(j, _)| *j)
    }

    /// The types of the deliveries entitled to run on concurrency key `key`.
    pub fn running_on(&self, key: &str) -> Vec<Option<Ty>> {
        self.deliveries
            .iter()
            .filter(|d| d.holder == Holder::Running && d.limited && d.key.as_deref() == Some(key))
            .map(|d| d.ty)
            .collect()
    }

    fn bound(&self, ty: Ty, key: &str) -> u32 {
        let limit = self.limits.get(&ty).copied().unwrap_or(u32::MAX);
        let carried = self.carried.get(key).map_or(0, |jobs| {
            self.deliveries
                .iter()
                .filter(|d| d.holder == Holder::Running && d.key.as_deref() == Some(key) && jobs.contains(&d.job_id))
                .count() as u32
        });
        limit.max(carried)
    }

    /// The checks that compare the model with one snapshot of the database: (a), (b), (c), (d),
    /// (e) as check_invariants() reports it before any sweep, (g), (i), (j), (k) and (l). Returns
    /// the violations.
    pub fn check(&self, st: &State, checks: &Checks) -> Vec<String> {
        let mut out = Vec::new();
        let running: Vec<&Delivery> = self.deliveries.iter().filter(|d| d.holder == Holder::Running).collect();

        // (a) G3: per key, the deliveries entitled to run never exceed the limit of any of their
        // types (on a key types share, the strictest binds: design §109).
        if checks.on('a') {
            let mut per_key: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
            for d in &running {
                if let (true, Some(key), Some(_)) = (d.limited, d.key.as_deref(), d.ty) {
                    per_key.entry(key).or_default().push(d);
                }
            }
            for (key, ds) in per_key {
                let types: BTreeSet<Ty> = ds.iter().filter_map(|d| d.ty).collect();
                let Some((bound, ty)) = types.iter().map(|ty| (self.bound(*ty, key), *ty)).min() else {
                    continue;
                };
                if ds.len() as u32 > bound {
                    let who: Vec<String> = ds.iter().map(|d| d.describe()).collect();
                    out.push(format!(
                        "(a) over-admission: key {key} has {} deliveries entitled to run, limit {bound} ({}): {}",
                        ds.len(),
                        ty.name(),
                        who.join("; ")
                    ));
                }
            }
        }

        // (a) G3, by permits: per key, the live permits never exceed the least current limit of
        // their holders' types (a holder whose type has no limit binds nothing, though its
        // permit counts) — whether or not their jobs run: a claim's own check may still park a
        // job admitted past a stricter holder before it starts (design §109), but the permit
        // was over the limit from its admission on. Keys that held permits when a limit was
        // lowered are left out (see `lowered_on`).
        if checks.on('a') {
            let mut per_key: BTreeMap<&str, Vec<Option<Ty>>> = BTreeMap::new();
            for l in st.leases.iter().filter(|l| l.live) {
                per_key.entry(l.key.as_str()).or_default().push(l.job_type.as_deref().and_then(Ty::from_name));
            }
            for (key, types) in per_key {
                if self.lowered_on.contains(key) {
                    continue;
                }
                let Some((limit, ty)) =
                    types.iter().flatten().filter_map(|ty| self.limits.get(ty).map(|l| (*l, *ty))).min()
                else {
                    continue;
                };
                if types.len() as u32 > limit {
                    out.push(format!(
                        "(a) over-admission: key {key} has {} live permits, of {:?}, limit {limit} ({})",
                        types.len(),
                        types.iter().map(|t| t.map_or("?", Ty::name)).collect::<Vec<_>>(),
                        ty.name()
                    ));
                }
            }
        }

        // (b) H24: a delivery entitled to run holds a live lease of its own key.
        if checks.on('b') {
            for d in &running {
                if !d.limited {
                    continue;
                }
                let Some(key) = d.key.as_deref() else {
                    out.push(format!("(b) {} of a limited type runs with no concurrency key", d.describe()));
                    continue;
                };
                match st.lease(d.queue, d.msg_id) {
                    None => out.push(format!("(b) {} runs without a lease row", d.describe())),
                    Some(l) if !l.live => out.push(format!("(b) {} runs on an expired lease", d.describe())),
                    Some(l) if l.key != key => {
                        out.push(format!("(b) {} runs on a lease of another key {}", d.describe(), l.key))
                    }
                    Some(_) => {}
                }
            }
        }

        // (c) G2/H2: value = lease rows of the key, and value <= lim.
        if checks.on('c') {
            let mut leases: BTreeMap<&str, i32> = BTreeMap::new();
            for l in &st.leases {
                *leases.entry(l.key.as_str()).or_default() += 1;
            }
            for (key, lim, value) in &st.semaphores {
                let n = leases.remove(key.as_str()).unwrap_or(0);
                if *value != n {
                    out.push(format!("(c) key {key}: semaphore value {value} but {n} lease rows"));
                }
                if value > lim || *value < 0 {
                    out.push(format!("(c) key {key}: semaphore value {value} outside 0..={lim}"));
                }
            }
            for (key, n) in leases {
                out.push(format!("(c) key {key}: {n} lease rows but no semaphore row"));
            }
        }

        // (d) G1: every committed job is in exactly one place, the one the model expects; no
        // rolled-back or unknown job appears anywhere.
        if checks.on('d') {
            let mut seen: BTreeMap<i64, Vec<String>> = BTreeMap::new();
            for m in &st.messages {
                seen.entry(m.job_id).or_default().push(format!("queue {} as msg {}", m.queue.name(), m.msg_id));
            }
            for (job, _) in &st.parked {
                seen.entry(*job).or_default().push("parked".into());
            }
            for (q, job) in &st.archived {
                seen.entry(*job).or_default().push(format!("archive of {}", q.name()));
            }
            for job in &st.dead {
                seen.entry(*job).or_default().push("dead letters".into());
            }
            for (job, places) in &seen {
                if self.rolled_back.contains(job) {
                    out.push(format!("(d) job {job}, enqueued in a rolled-back transaction, is in {places:?}"));
                } else if !self.jobs.contains_key(job) {
                    out.push(format!("(d) unknown job {job} is in {places:?}"));
                }
            }
            for (job, fate) in &self.jobs {
                let places = seen.get(job).cloned().unwrap_or_default();
                let expected = |p: &String| match fate {
                    Fate::Live => p.starts_with("queue") || p == "parked",
                    Fate::Archived | Fate::Cancelled => p.starts_with("archive"),
                    Fate::DeadLettered => p == "dead letters",
                    Fate::Discarded => false,
                };
                if *fate == Fate::Discarded {
                    if !places.is_empty() {
                        out.push(format!("(d) job {job} was discarded, but is in {places:?}"));
                    }
                } else if places.len() != 1 || !expected(&places[0]) {
                    out.push(format!("(d) job {job} should be {fate:?} exactly once, but is in {places:?}"));
                }
            }
        }

        // (e) check_invariants() before any sweep; the runner re-asks after a sweep (rolled
        // back) before calling it a violation.
        if checks.on('e') && !st.invariants.is_empty() {
            out.push(format!("(e) check_invariants(): {:?}", st.invariants));
        }

        // (i) G2/H14: one lock row per live unique job, owned by it; none for a finished one.
        if checks.on('i') && self.bookkeeping {
            let mut expected: Vec<(String, i64)> = self
                .unique
                .iter()
                .filter(|(job, _)| self.jobs.get(job) == Some(&Fate::Live))
                .map(|(job, key)| (key.clone(), *job))
                .collect();
            expected.sort();
            if st.unique_locks != expected {
                out.push(format!("(i) unique locks {:?}, expected {expected:?}", st.unique_locks));
            }
        }

        // (k) G3/H14: per while_executing key, at most one delivery entitled to run.
        if checks.on('k') {
            let mut per_key: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
            for d in &running {
                if let Some(key) = d.wkey.as_deref() {
                    per_key.entry(key).or_default().push(d);
                }
            }
            for (key, ds) in per_key {
                if ds.len() > 1 {
                    let who: Vec<String> = ds.iter().map(|d| d.describe()).collect();
                    out.push(format!(
                        "(k) while_executing key {key} has {} deliveries entitled to run at once: {}",
                        ds.len(),
                        who.join("; ")
                    ));
                }
            }
        }

        // (l) G2: the while_executing lock rows are exactly those the model expects: one per
        // key whose run has not ended, owned by that job; a cancelled running job's kept (with a
        // held_until) until its worker released it, and after its held_until has passed until a
        // claim took the key over.
        if checks.on('l') && self.bookkeeping {
            let expected: Vec<(String, i64, Option<bool>)> =
                self.wlocks.iter().map(|(key, l)| (key.clone(), l.job, l.kept.map(|_| l.lapsed))).collect();
            if st.wexec_locks != expected {
                out.push(format!(
                    "(l) while_executing locks (key, job, held_until passed) {:?}, expected {expected:?} (kept for: {:?})",
                    st.wexec_locks,
                    self.wlocks.iter().filter_map(|(k, l)| l.kept.map(|i| format!("{k}: d{i}"))).collect::<Vec<_>>()
                ));
            }
        }

        // (j) G2/H22: the batch counts every committed job enqueued into it once, by its fate;
        // it finishes exactly when it is closed and every one of them has a fate (the batch
        // sweep finishing one that no completion could), and its callback is enqueued once then.
        if checks.on('j') && self.bookkeeping {
            let count = |fate: Fate| {
                self.batch_jobs
                    .iter()
                    .filter(|j| !self.retried_out.contains(*j) && self.jobs.get(*j) == Some(&fate))
                    .count() as i64
            };
            let expected = (
                self.batch_jobs.len() as i64,
                count(Fate::Archived),
                count(Fate::DeadLettered)
                    + count(Fate::Cancelled)
                    + count(Fate::Discarded)
                    + self.retried_out.len() as i64,
            );
            if st.batch != Some(expected) {
                out.push(format!("(j) batch (total, succeeded, failed) is {:?}, expected {expected:?}", st.batch));
            }
            let state = self.batch_state();
            if st.batch_state.as_deref() != Some(state) {
                out.push(format!("(j) batch state is {:?}, expected {state}", st.batch_state));
            }
            let callbacks = i64::from(state == "finished");
            if st.batch_callbacks != callbacks {
                out.push(format!(
                    "(j) the batch's callback was enqueued {} times, expected {callbacks}",
                    st.batch_callbacks
                ));
            }
        }

        // (g) H26: a job has at most one delivery entitled to run.
        if checks.on('g') {
            let mut per_job: BTreeMap<i64, Vec<&Delivery>> = BTreeMap::new();
            for d in &running {
                per_job.entry(d.job_id).or_default().push(d);
            }
            for (job, ds) in per_job {
                if ds.len() > 1 {
                    let who: Vec<String> = ds.iter().map(|d| d.describe()).collect();
                    out.push(format!("(g) job {job} runs twice at once: {}", who.join("; ")));
                }
            }
        }
        out
    }
}
