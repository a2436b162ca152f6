//! The operations a schedule is made of, as plain data (so proptest can generate and shrink them),
//! and how they are generated. Operations name their targets by position ("the 3rd running
//! delivery"), resolved when they run, so a shrunk schedule stays meaningful after earlier
//! operations are removed.

use std::fmt;

use proptest::collection::vec;
use proptest::prelude::*;

/// The job types of the model: two limited ones on two queues, an unlimited one, and two unique
/// ones (until executed; while executing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ty {
    /// Limited, key from argument `k`, on queue `default`. A job with `k` = `SHARED_K` names its
    /// concurrency key explicitly, the one `limb` names: two limits meet on one key.
    Lim,
    /// Unlimited, on queue `default` (its jobs share claims with `lim`), unless the case starts
    /// it limited (`Case::free_limit`) or a redefinition gives it a limit (key from `k` too).
    /// While it is limited, a job with `k` = `SHARED_K` names the concurrency key `lim` and
    /// `limb` name: three limits meet on one key, and a redefinition may remove one of them
    /// (its jobs then run without a permit; its running holders keep theirs until they finish).
    Free,
    /// Limited, key from argument `k`, on queue `other`. A job with `k` = `SHARED_K` names its
    /// concurrency key explicitly, the one `lim` names.
    LimB,
    /// Unique until executed, key from argument `k`, duplicates discarded; unlimited unless the
    /// case starts it limited (`Case::uniq_limit`) or a redefinition gives it a limit, on queue
    /// `default`. Plain unlimited on an older schema. A job with `k` = `SHARED_K` names its
    /// unique key explicitly, the one `wexec` names, and while its type is limited the
    /// concurrency key `SHARED_CKEY` too: a job holding the unique key may be parked on the
    /// concurrency key a `wexec` job waiting for that unique key holds a permit of (design §114).
    Uniq,
    /// Unique while executing, key from argument `k`, duplicates rejected: a claim that meets
    /// its key held puts the job back for a second (a return, no delivery), giving back the
    /// concurrency permit it holds when its type is limited (design §114). Unlimited unless the
    /// case starts it limited (`Case::wexec_limit`, half the cases) or a redefinition gives it a
    /// limit, on queue `default`. Plain unlimited on an older schema. A job with `k` = `SHARED_K`
    /// names its unique key explicitly, the one `uniq` names: the two modes meet on one key; and
    /// while its type is limited the concurrency key `SHARED_CKEY` too, the one `lim`, `limb`,
    /// a limited `free` and a limited `uniq` name.
    Wexec,
}

impl Ty {
    pub const ALL: [Ty; 5] = [Ty::Lim, Ty::Free, Ty::LimB, Ty::Uniq, Ty::Wexec];

    pub fn name(self) -> &'static str {
        match self {
            Ty::Lim => "lim",
            Ty::Free => "free",
            Ty::LimB => "limb",
            Ty::Uniq => "uniq",
            Ty::Wexec => "wexec",
        }
    }

    pub fn from_name(name: &str) -> Option<Ty> {
        Ty::ALL.into_iter().find(|t| t.name() == name)
    }

    /// How many values of argument `k` its jobs take: the types that name a shared key one more,
    /// `SHARED_K`.
    pub fn ks(self) -> u8 {
        match self {
            Ty::Uniq | Ty::Wexec | Ty::Lim | Ty::LimB | Ty::Free => SHARED_K + 1,
        }
    }

    pub fn queue(self) -> Queue {
        match self {
            Ty::Lim | Ty::Free | Ty::Uniq | Ty::Wexec => Queue::Default,
            Ty::LimB => Queue::Other,
        }
    }
}

/// The argument `k` of a single enqueue that names a key explicitly: of `uniq` or `wexec`, the
/// unique key `shared` (the `unique_key` option), so that jobs of both types, one taking the key
/// at enqueue and the other when its run starts, contend for it; of `lim`, `limb` or (while its
/// type is limited) `free`, `uniq` or `wexec`, the concurrency key `SHARED_CKEY`. Never in an
/// `enqueue_many`, whose options name one key for every job of the call.
pub const SHARED_K: u8 = 2;

/// The explicit unique key of `SHARED_K`.
pub const SHARED_KEY: &str = "shared";

/// The explicit concurrency key of `SHARED_K` in a single enqueue of `lim`, `limb` or a limited
/// `free`, `uniq` or `wexec` (the `concurrency_key` option): jobs of up to five types, of
/// different limits and queues, take permits of one key (design §109); a type without a limit
/// takes no key.
pub const SHARED_CKEY: &str = "cshared";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Queue {
    Default,
    Other,
}

impl Queue {
    pub const ALL: [Queue; 2] = [Queue::Default, Queue::Other];

    pub fn name(self) -> &'static str {
        match self {
            Queue::Default => "default",
            Queue::Other => "other",
        }
    }

    pub fn from_name(name: &str) -> Option<Queue> {
        Queue::ALL.into_iter().find(|q| q.name() == name)
    }

    /// `pgmq.q_<name>` (kind "q") or `pgmq.a_<name>` (kind "a").
    pub fn table(self, kind: &str) -> String {
        format!("pgmq.{kind}_{}", self.name())
    }
}

/// How the holder of a running delivery finishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Complete,
    /// A failed attempt retried in place, visible at once or after an hour's backoff.
    Retry {
        backoff: bool,
    },
    /// Shutdown return: visible at once, keeping its permit.
    Release,
    DeadLetter,
}

/// What a stale delivery (its message re-claimed, or finished by someone) tries to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleAction {
    Complete,
    Retry,
    Release,
    DeadLetter,
    Extend,
    /// `lockgate.extend_cancelled` (design §95): a stale token must renew nothing a cancel kept.
    ExtendCancelled,
}

#[derive(Clone, Debug)]
pub enum Op {
    /// `lockgate.enqueue` on the producer connection, committed.
    Enqueue { ty: Ty, k: u8 },
    /// `lockgate.enqueue_many` on the producer connection, committed.
    EnqueueMany { ty: Ty, ks: Vec<u8> },
    /// An enqueue inside a transaction that is rolled back; the model is checked while it is open.
    EnqueueRolledBack { ty: Ty, k: u8 },
    /// `lockgate.claim` on worker connection `worker`, as that worker's registered process.
    Claim { worker: usize, queue: Queue, qty: u8 },
    /// A claim on a worker connection while a sweep on the dispatcher connection has run but not
    /// committed; the sweep commits once the claim waits on its locks (or has returned).
    ClaimRacingSweep { worker: usize, queue: Queue, qty: u8 },
    /// A heartbeat renewing the running deliveries picked by the bits of `mask` (first 8). A
    /// delivery it finds lost stops; one whose job was cancelled (`cancelled_messages`) then gives
    /// back what the cancel kept for it (`release_cancelled`) — unless `blocked`: its handler,
    /// told, does not stop (it blocks its thread), and runs on, renewed. With `blocked`, every
    /// handler already blocking so is renewed through `extend_cancelled`; without, those picked
    /// have ended, and give back what their cancel kept (design §95).
    Extend { mask: u8, blocked: bool },
    /// The holder of the `pick`-th running delivery finishes it; refused, it calls
    /// `release_cancelled`, as the runtime does.
    Finish { pick: usize, how: Finish },
    /// While a producer's transaction is open on the `pick`-th running delivery's key (it
    /// enqueued a job of the delivery's type and key: it holds the key's row), the holder
    /// finishes the delivery, which must not wait for that row; then the producer commits or
    /// rolls back.
    FinishBehindProducer { pick: usize, how: Finish, commit: bool },
    /// The holder of the `pick`-th running delivery takes a REPEATABLE READ snapshot; a producer
    /// then enqueues a job of the delivery's type and key and commits (parked behind it when the
    /// key is full); the holder finishes in the older snapshot and commits (design §78).
    FinishOnOldSnapshot { pick: usize, how: Finish },
    /// The holder of the `pick`-th delivery that ran out of budget or was told it lost — frozen
    /// and thawed, say — finishes it anyway: whatever the database answers, every check must
    /// still hold.
    Thaw { pick: usize, how: Finish },
    /// The `pick`-th provably stale delivery token is used.
    Stale { pick: usize, action: StaleAction },
    /// `lockgate.sweep` on the dispatcher connection.
    Sweep,
    /// The registry heartbeat of worker `worker`'s process stalls past the alive threshold while
    /// its job heartbeats stay healthy; `lockgate.prune_processes` runs; the process re-registers.
    Prune { worker: usize },
    /// Clock: the lease of the `pick`-th visible (waiting) message runs out — what a backlog
    /// longer than the duration does — or the lease a cancel kept for a running delivery (its
    /// message is gone; the lease ends after that delivery's budget).
    LapseLease { pick: usize },
    /// Clock: the visibility of the `pick`-th invisible message passes (a holder silent past its
    /// visibility while its lease still holds, or a retry's backoff elapsing), or the budget of
    /// the `pick`-th delivery a cancel left running (the visibility it had at the cancel).
    LapseVisibility { pick: usize },
    /// Clock: the holder of the `pick`-th running delivery goes silent past its budget:
    /// visibility and lease both run out.
    Silence { pick: usize },
    /// Clock (the drain's, never generated): the lease a cancel kept for the `pick`-th delivery
    /// whose handler stopped without giving it back (its holder ran out of budget) runs out: the
    /// one lease lapse the drain without lapsed leases (check (p)) still needs.
    LapseKeptLease { pick: usize },
    /// `lockgate.define_job_type` again with another limit (for `free`: its first); 0 removes
    /// the limit (the type's parked jobs are promoted unlimited, its running jobs keep their
    /// permits until they finish).
    Redefine { ty: Ty, limit: u32 },
    /// `lockgate.cancel` of the `pick`-th live job (in id order), whatever state it is in. A
    /// running job's holder is not told: it runs on until a heartbeat, a refused finish or its
    /// budget stops it.
    Cancel { pick: usize },
    /// `lockgate.close_batch` of the case's batch: later enqueues go outside it. With `during`
    /// (type, k, commit), while an enqueue of that job into the batch is open on the producer
    /// connection, which then commits or rolls back.
    Close { during: Option<(Ty, u8, bool)> },
    /// `lockgate.dlq_retry` of the `pick`-th dead-lettered job (in id order): sent again as a new
    /// message of its queue with no lease (its next claim takes a permit or parks it), a unique
    /// job taking its key again unless another live job holds it (then it stays dead, a
    /// duplicate). It leaves the batch, which counted it as failed.
    DlqRetry { pick: usize },
    /// `lockgate.discard_job` of the `pick`-th dead-lettered or parked job (in id order): deleted
    /// for good, a parked one counted as failed in its batch and its unique key released.
    Discard { pick: usize },
    /// The bookkeeping sweep's reapers with no age floor: `lockgate.reclaim_idle_keys` deletes
    /// every key row with no permit held and nothing parked, `lockgate.reap_unique_locks` every
    /// lock whose job is gone and every kept lock whose held_until has passed.
    Reap,
}

/// One generated case: the initial limits of `lim`, `limb`, `free`, `wexec` and `uniq` (None:
/// unlimited), and the schedule.
#[derive(Clone, Debug)]
pub struct Case {
    pub lim_limit: u32,
    pub limb_limit: u32,
    pub free_limit: Option<u32>,
    pub wexec_limit: Option<u32>,
    pub uniq_limit: Option<u32>,
    pub ops: Vec<Op>,
}

impl Op {
    /// The operation's name, for the run's summary.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Enqueue { .. } => "enqueue",
            Op::EnqueueMany { .. } => "enqueue_many",
            Op::EnqueueRolledBack { .. } => "enqueue rolled back",
            Op::Claim { .. } => "claim",
            Op::ClaimRacingSweep { .. } => "claim racing a sweep",
            Op::Extend { .. } => "extend",
            Op::Finish { how: Finish::Complete, .. } => "complete",
            Op::Finish { how: Finish::Retry { .. }, .. } => "retry",
            Op::Finish { how: Finish::Release, .. } => "release",
            Op::Finish { how: Finish::DeadLetter, .. } => "dead_letter",
            Op::FinishBehindProducer { .. } => "finish while a producer holds the key",
            Op::FinishOnOldSnapshot { .. } => "finish on a snapshot older than an enqueue",
            Op::Thaw { .. } => "finish after the budget ran out",
            Op::Stale { .. } => "stale token",
            Op::Sweep => "sweep",
            Op::Prune { .. } => "prune",
            Op::LapseLease { .. } => "lease runs out",
            Op::LapseVisibility { .. } => "visibility passes",
            Op::Silence { .. } => "holder silent",
            Op::LapseKeptLease { .. } => "kept lease runs out",
            Op::Redefine { limit: 0, .. } => "remove limit",
            Op::Redefine { .. } => "redefine limit",
            Op::Cancel { .. } => "cancel",
            Op::Close { during: None } => "close batch",
            Op::Close { during: Some(_) } => "close batch during an enqueue",
            Op::DlqRetry { .. } => "dlq_retry",
            Op::Discard { .. } => "discard",
            Op::Reap => "reap keys and locks",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Enqueue { ty, k } => write!(f, "enqueue {} {{k:{k}}}", ty.name()),
            Op::EnqueueMany { ty, ks } => write!(f, "enqueue_many {} k={ks:?}", ty.name()),
            Op::EnqueueRolledBack { ty, k } => {
                write!(f, "enqueue {} {{k:{k}}} in a transaction rolled back", ty.name())
            }
            Op::Claim { worker, queue, qty } => write!(f, "claim {qty} from {} as worker {worker}", queue.name()),
            Op::ClaimRacingSweep { worker, queue, qty } => {
                write!(f, "claim {qty} from {} as worker {worker} racing an uncommitted sweep", queue.name())
            }
            Op::Extend { mask, blocked: false } => write!(f, "extend running deliveries of mask {mask:#010b}"),
            Op::Extend { mask, blocked: true } => {
                write!(f, "extend running deliveries of mask {mask:#010b}, cancelled handlers blocking")
            }
            Op::Finish { pick, how } => write!(f, "{how:?} running delivery #{pick}"),
            Op::FinishBehindProducer { pick, how, commit } => write!(
                f,
                "{how:?} running delivery #{pick} while a producer's enqueue on its key is open, then {}",
                if *commit { "commit it" } else { "roll it back" }
            ),
            Op::FinishOnOldSnapshot { pick, how } => write!(
                f,
                "{how:?} running delivery #{pick} at REPEATABLE READ, its snapshot taken before a committed enqueue on its key"
            ),
            Op::Thaw { pick, how } => write!(f, "{how:?} by the out-of-budget holder of delivery #{pick}"),
            Op::Stale { pick, action } => write!(f, "stale {action:?} with stale token #{pick}"),
            Op::Sweep => write!(f, "sweep"),
            Op::Prune { worker } => write!(f, "registry of worker {worker} stalls; prune_processes"),
            Op::LapseLease { pick } => write!(f, "clock: lease of waiting or cancelled message #{pick} runs out"),
            Op::LapseVisibility { pick } => write!(f, "clock: visibility of invisible message #{pick} passes"),
            Op::Silence { pick } => write!(f, "clock: holder of running delivery #{pick} silent past its budget"),
            Op::LapseKeptLease { pick } => {
                write!(f, "clock: lease a cancel kept for stopped handler #{pick} runs out")
            }
            Op::Redefine { ty, limit: 0 } => write!(f, "redefine {} without a limit", ty.name()),
            Op::Redefine { ty, limit } => write!(f, "redefine {} with limit {limit}", ty.name()),
            Op::Cancel { pick } => write!(f, "cancel live job #{pick}"),
            Op::Close { during: None } => write!(f, "close the batch"),
            Op::Close { during: Some((ty, k, commit)) } => write!(
                f,
                "close the batch while an enqueue of {} {{k:{k}}} into it is open, then {}",
                ty.name(),
                if *commit { "commit it" } else { "roll it back" }
            ),
            Op::DlqRetry { pick } => write!(f, "dlq_retry of dead-lettered job #{pick}"),
            Op::Discard { pick } => write!(f, "discard dead-lettered or parked job #{pick}"),
            Op::Reap => write!(f, "reclaim idle keys and reap unique locks, no age floor"),
        }
    }
}

fn ty() -> impl Strategy<Value = Ty> {
    prop_oneof![3 => Just(Ty::Lim), 2 => Just(Ty::Free), 2 => Just(Ty::LimB), 2 => Just(Ty::Uniq), 2 => Just(Ty::Wexec)]
}

fn queue() -> impl Strategy<Value = Queue> {
    prop_oneof![2 => Just(Queue::Default), 1 => Just(Queue::Other)]
}

fn finish() -> impl Strategy<Value = Finish> {
    prop_oneof![
        4 => Just(Finish::Complete),
        2 => any::<bool>().prop_map(|backoff| Finish::Retry { backoff }),
        2 => Just(Finish::Release),
        2 => Just(Finish::DeadLetter),
    ]
}

fn stale_action() -> impl Strategy<Value = StaleAction> {
    prop_oneof![
        Just(StaleAction::Complete),
        Just(StaleAction::Retry),
        Just(StaleAction::Release),
        Just(StaleAction::DeadLetter),
        Just(StaleAction::Extend),
        Just(StaleAction::ExtendCancelled),
    ]
}

/// A type and an argument `k` for a single enqueue of it.
fn ty_and_k() -> impl Strategy<Value = (Ty, u8)> {
    ty().prop_flat_map(|ty| (Just(ty), 0..ty.ks()))
}

/// Weighted so that keys fill up, jobs wait long enough for leases to lapse, and sweeps and
/// claims interleave with them often.
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => ty_and_k().prop_map(|(ty, k)| Op::Enqueue { ty, k }),
        1 => (ty(), vec(0..2u8, 1..4)).prop_map(|(ty, ks)| Op::EnqueueMany { ty, ks }),
        1 => ty_and_k().prop_map(|(ty, k)| Op::EnqueueRolledBack { ty, k }),
        7 => (0..2usize, queue(), 1..4u8).prop_map(|(worker, queue, qty)| Op::Claim { worker, queue, qty }),
        2 => (0..2usize, queue(), 1..4u8).prop_map(|(worker, queue, qty)| Op::ClaimRacingSweep { worker, queue, qty }),
        4 => (any::<u8>(), any::<bool>()).prop_map(|(mask, blocked)| Op::Extend { mask, blocked }),
        5 => (0..8usize, finish()).prop_map(|(pick, how)| Op::Finish { pick, how }),
        2 => (0..8usize, finish(), any::<bool>())
            .prop_map(|(pick, how, commit)| Op::FinishBehindProducer { pick, how, commit }),
        2 => (0..8usize, finish()).prop_map(|(pick, how)| Op::FinishOnOldSnapshot { pick, how }),
        1 => (0..8usize, finish()).prop_map(|(pick, how)| Op::Thaw { pick, how }),
        3 => (0..8usize, stale_action()).prop_map(|(pick, action)| Op::Stale { pick, action }),
        4 => Just(Op::Sweep),
        1 => (0..2usize).prop_map(|worker| Op::Prune { worker }),
        3 => (0..4usize).prop_map(|pick| Op::LapseLease { pick }),
        2 => (0..4usize).prop_map(|pick| Op::LapseVisibility { pick }),
        2 => (0..8usize).prop_map(|pick| Op::Silence { pick }),
        1 => (ty(), 1..=3u32).prop_map(|(ty, limit)| Op::Redefine { ty, limit }),
        1 => ty().prop_map(|ty| Op::Redefine { ty, limit: 0 }),
        2 => (0..8usize).prop_map(|pick| Op::Cancel { pick }),
        1 => proptest::option::of((ty_and_k(), any::<bool>())).prop_map(|during| Op::Close {
            during: during.map(|((ty, k), commit)| (ty, k, commit))
        }),
        2 => (0..4usize).prop_map(|pick| Op::DlqRetry { pick }),
        1 => (0..4usize).prop_map(|pick| Op::Discard { pick }),
        1 => Just(Op::Reap),
    ]
}

/// Schedules of 1 to `max_steps` operations (shrinking can take a failing one down to the
/// few steps that matter). Half the cases start `free` limited (1 to 3), so that its jobs name
/// the shared key from the first step; the others leave it unlimited (shrinking towards that).
/// Independently, half start `wexec` limited (1 or 2) and half `uniq` (1 or 2), so that a
/// `wexec` job waiting for the shared unique key holds a permit of the shared concurrency key,
/// which a `uniq` job holding that unique key may be parked on (design §114).
pub fn case(max_steps: usize) -> impl Strategy<Value = Case> {
    let free_limit = prop_oneof![Just(None), (1..=3u32).prop_map(Some)];
    let wexec_limit = prop_oneof![Just(None), (1..=2u32).prop_map(Some)];
    let uniq_limit = prop_oneof![Just(None), (1..=2u32).prop_map(Some)];
    (1..=2u32, 1..=3u32, free_limit, wexec_limit, uniq_limit, vec(op(), 1..=max_steps.max(1))).prop_map(
        |(lim_limit, limb_limit, free_limit, wexec_limit, uniq_limit, ops)| Case {
            lim_limit,
            limb_limit,
            free_limit,
            wexec_limit,
            uniq_limit,
            ops,
        },
    )
}
