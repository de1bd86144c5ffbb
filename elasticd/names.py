"""Every name elasticd shares across processes, in one place: the worker environment it adds to
torchrun's, the control socket's commands, and the keys of the rendezvous store. (The settings'
ELASTICD_<KEY> variables come from config's fields.)

Imported by worker-side code too, so it imports nothing.
"""

# --- the worker environment (set by daemon/spawn.worker_env, read inside the worker) ---

AGENT = (
    "ELASTICD_AGENT"  # the daemon's token: the cleanup sweep and the guard find descendants by it
)
DAEMON_PID = "ELASTICD_DAEMON_PID"  # the parent-death check compares its parent with it
ENTRYPOINT = (
    "ELASTICD_ENTRYPOINT"  # what bootstrap runs: a script, module, module:function or executable
)
NO_PYTHON = (
    "ELASTICD_NO_PYTHON"  # set: ENTRYPOINT is an executable bootstrap execs (torchrun --no-python)
)
HEARTBEAT_FILE = "ELASTICD_HEARTBEAT_FILE"  # the rank's heartbeat file (elasticd.worker.heartbeat)


STACK_FILE = "ELASTICD_STACK_FILE"  # where faulthandler appends the rank's stacks
STACK_SIGNAL = "ELASTICD_STACK_SIGNAL"  # the signal that asks for them
# where the rank writes its collectives as torch's Flight Recorder keeps them, when the daemon
# asks through the FIFO beside it (elasticd.worker.flight)
COLLECTIVES_FILE = "ELASTICD_COLLECTIVES_FILE"
ATTEMPT_DIR = "ELASTICD_ATTEMPT_DIR"  # this attempt's directory of logs and error files
CHECKPOINT_DIR = "ELASTICD_CHECKPOINT_DIR"  # where elasticd.checkpoint keeps the job's checkpoints
# the daemon's /dev/shm directory of in-memory state (elasticd.checkpoint.memory)
MEMORY_DIR = "ELASTICD_MEMORY_DIR"
# the key (hex) of the MACs on the in-memory state's bytes that cross the network, derived from
# the job secret (elasticd.checkpoint.memory.seal)
STATE_KEY = "ELASTICD_STATE_KEY"
# the worker's local rank, which names its in-memory slots (LOCAL_RANK is 0 for every worker under
# --virtual-local-rank)
LOCAL_RANK = "ELASTICD_LOCAL_RANK"
# the attempt's round number: with MASTER_ADDR:PORT it names the attempt (elasticd.ledger)
ROUND_NUMBER = "ELASTICD_ROUND"
# set (--ledger): the directory where each worker writes its per-sample ledger (elasticd.ledger)
LEDGER_DIR = "ELASTICD_LEDGER_DIR"
# set for every worker of a job on the in-place path (daemon/inplace.py): the generation of the
# group it joins, 0 at an attempt's start, N for a spare that replaces a failed rank in place
IN_PLACE_GEN = "ELASTICD_IN_PLACE_GEN"
# set by `elasticd replay` in the one process that re-runs a failed step
# (elasticd.checkpoint.bundle): the bundle, the rank and world it stands for ("R/W": the sampler
# deals that rank's samples), and the file where the replay leaves its result for the CLI
REPLAY = "ELASTICD_REPLAY"
REPLAY_AS = "ELASTICD_REPLAY_AS"
REPLAY_RESULT = "ELASTICD_REPLAY_RESULT"
# set by the referee of two disagreeing replicas (daemon/referee.py) in its replays: where the
# first leaves its rank's local gradients of the disputed step, and where the second reads them
REFEREE_GRADS_OUT = "ELASTICD_REFEREE_GRADS_OUT"
REFEREE_GRADS_IN = "ELASTICD_REFEREE_GRADS_IN"
WARM_PRELOAD = "ELASTICD_WARM_PRELOAD"  # modules a warm spare or the fork server imports ahead
SOCKET = (
    "ELASTICD_SOCKET"  # the control socket, for the CLI and the daemon (also the `socket` setting)
)
USER_CPP_LOG_LEVEL = (
    "ELASTICD_USER_TORCH_CPP_LOG_LEVEL"  # the user's TORCH_CPP_LOG_LEVEL, kept for workers
)
SETTING_PREFIX = "ELASTICD_"  # ELASTICD_<SETTING> variables are a config layer

# --- a worker's exit code the daemon reads as the library's verdict, not the script's

# the replicas' audit found silent data corruption (elasticd.checkpoint.audit): every rank ends
# with it, the daemon restarts from the newest certified state and judges the rank blamed
SDC_EXIT = 86

# --- control commands (how each is served: control.commands.COMMANDS; the loop's: agent.FORWARDED)

STATUS = "status"  # the daemon's snapshot, served by the control thread
STOP = "stop"  # a graceful stop, with an optional grace `timeout`
STACKS = "stacks"  # every local worker's thread stacks, now

# --- control-plane store keys (elasticd.cluster.rendezvous; each value signed: cluster.signing)
# A job's run is under elasticd/<job>/<run>/ (<run>: a random nonce, elasticd/<job>/run, so that
# a value of an earlier run of the same --rdzv-id never verifies in this one); a round's under
# elasticd/<job>/<run>/r<round>/. Rendezvous passes "<job>/<run>" as `job` below.

RUN = "run"  # elasticd/<job>/run: the run's nonce and when it began (the only key outside a run)

# per run
ROUND = "round"  # the newest round any node has entered: where a node that arrives joins
# set once the job has ended, with when and why (a failure's summary): later nodes leave with it
CLOSED = "closed"
RESTARTS = "restarts"  # the job's restart budget spent so far (a signed compare-and-set)
# on a c10d store: the challenges of nodes that would follow the run (random nonces, the newest
# last), and the store's host's beat in the run, a counter and the challenges it read there: a
# node follows a run only once its host has answered the node's own challenge (cluster/run.py)
HELLO = "hello"
HOST = "host"

# per round
ARRIVED = (
    "arrived"  # a counter (under a tag only the job's nodes can make): each arrival takes a number
)
MEMBERS = "members"  # the round as closed: its nodes in group-rank order, and the nodes found lost
MASTER = "master"  # "addr port" of the round's worker store, hosted by group rank 0
RESTART = "restart"  # the first restart request's reason: every node of the round restarts
REPLAY_ASK = "replay_ask"  # where the failed node copied its rank's bundle, for another's replay
REPLAYED_ELSEWHERE = "replayed"  # that other node's replay of the failed step: its verdict
REFEREE_ASK = "referee_ask"  # two replicas on two nodes: where rank 1's node copied its bundle
REFEREED = "refereed"  # the referee's verdict (rank 0's node), for rank 1's node
HANG = "hang"  # hang/[<inquiry>/]<node id>: that node's ranks' innermost frames at a hang
HANG_ASK = "hang_ask"  # hang_ask/<i>: the node that asks the others for their stacks, in place
HANG_VERDICT = "hang_verdict"  # hang_verdict/<i>: its verdict, the culprit's rank and node
DONE_COUNT = "done_count"  # a counter of nodes at the exit barrier
ALL_DONE = "all_done"  # set once every node's done key verifies

# --- the workers' store (the round's, at MASTER_ADDR:MASTER_PORT): in-place recovery's keys,
# each value signed with the job's state key (worker/reconfigure.py `sign`)


def in_place_key(generation: int, rank: int | None = None) -> str:
    """The daemon's word that generation N of the group is forming (rank None), or the
    reconfigure handle rank R gives for it (worker/reconfigure.py)."""
    where = f"elasticd/in-place/g{generation}"
    return where if rank is None else f"{where}/h{rank}"


def in_place_counter_key() -> str:
    """The roll of the round's in-place generations (KV `take`): a daemon that replaces ranks
    takes the next number, so the nodes of a job never announce the same generation twice."""
    return "elasticd/in-place/next"


def in_place_waiting_key(generation: int) -> str:
    """How many ranks unwound from a failed collective wait for generation N (a counter each
    adds 1 to): before it is announced, the daemons' evidence that a silent node is gone."""
    return f"elasticd/in-place/g{generation}/waiting"


def in_place_unwound_key(generation: int, rank: int) -> str:
    """Rank R's word that its script unwound for generation N (it re-forms or falls back
    itself: daemon/inplace.py `unstick` kills only a rank that said neither)."""
    return f"elasticd/in-place/g{generation}/u{rank}"


def pairs_file(heartbeat: str) -> str:
    """Beside a rank's heartbeat file: the sockets its group's latest forming made (worker/
    reconfigure.py writes, daemon/outside_abort.py reads)."""
    return f"{heartbeat}.pairs"


def job_key(job: str, name: str) -> str:
    return f"elasticd/{job}/{name}"


def round_key(job: str, number: int, name: str) -> str:
    return f"elasticd/{job}/r{number}/{name}"


def arrivals_key(job: str, number: int, tag: str) -> str:
    """The round's arrival counter: `tag` is derived from the job secret, so no one without it can
    raise the counter before the round's first node has taken its number."""
    return round_key(job, number, f"{ARRIVED}/{tag}")


def arrival_key(job: str, number: int, tag: str, index: int) -> str:
    """The record of the node that claimed arrival number `index` in a round (id, address,
    nproc)."""
    return round_key(job, number, f"node/{tag}/{index}")


def done_key(job: str, number: int, group_rank: int) -> str:
    """Set by a node at the exit barrier."""
    return round_key(job, number, f"done/{group_rank}")


def alive_key(job: str, node_id: str) -> str:
    """A node's liveness counter, raised every few tenths of a second for as long as its daemon
    runs."""
    return f"elasticd/{job}/alive/{node_id}"
