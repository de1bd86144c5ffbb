"""Every name elasticd shares across processes, in one place: the worker environment it adds to
torchrun's, the control socket's commands, and the keys of the rendezvous store. (The settings'
ELASTICD_<KEY> variables come from config's fields.)

Imported by worker-side code too, so it imports nothing.
"""

# --- the worker environment (set by workers.worker_env, read inside the worker) ---

AGENT = "ELASTICD_AGENT"  # the daemon's token: the cleanup sweep and the guard find descendants by it
DAEMON_PID = "ELASTICD_DAEMON_PID"  # the parent-death check compares its parent with it
ENTRYPOINT = "ELASTICD_ENTRYPOINT"  # what bootstrap runs: a script, module, module:function or executable
NO_PYTHON = "ELASTICD_NO_PYTHON"  # set: ENTRYPOINT is an executable bootstrap execs (torchrun --no-python)
HEARTBEAT_FILE = "ELASTICD_HEARTBEAT_FILE"  # the rank's heartbeat file (elasticd.health)
STACK_FILE = "ELASTICD_STACK_FILE"  # where faulthandler appends the rank's stacks
STACK_SIGNAL = "ELASTICD_STACK_SIGNAL"  # the signal that asks for them
ATTEMPT_DIR = "ELASTICD_ATTEMPT_DIR"  # this attempt's directory of logs and error files
CHECKPOINT_DIR = "ELASTICD_CHECKPOINT_DIR"  # where elasticd.checkpoint keeps the job's checkpoints
MEMORY_DIR = "ELASTICD_MEMORY_DIR"  # the daemon's /dev/shm directory of in-memory state (elasticd.memory)
LOCAL_RANK = "ELASTICD_LOCAL_RANK"  # the worker's local rank, which names its in-memory slots (LOCAL_RANK is 0 for
#                                     every worker under --virtual-local-rank)
WARM_PRELOAD = "ELASTICD_WARM_PRELOAD"  # modules a warm spare or the fork server imports ahead
SOCKET = "ELASTICD_SOCKET"  # the control socket, for the CLI and the daemon (also the `socket` setting)
USER_CPP_LOG_LEVEL = "ELASTICD_USER_TORCH_CPP_LOG_LEVEL"  # the user's TORCH_CPP_LOG_LEVEL, kept for workers
SETTING_PREFIX = "ELASTICD_"  # ELASTICD_<SETTING> variables are a config layer

# --- control commands (how each is served: control.COMMANDS; the loop's side: agent.FORWARDED) ---

STATUS = "status"  # the daemon's snapshot, served by the control thread
STOP = "stop"  # a graceful stop, with an optional grace `timeout`
STACKS = "stacks"  # every local worker's thread stacks, now

# --- rendezvous store keys (each value signed: elasticd.signing) ---

# per round, under torch's round prefix
RESTART = "elasticd/restart"  # the first failure's reason: every node restarts the round
MASTER = "elasticd/master"  # "addr port" of the round's worker store, hosted by group rank 0


def nproc_key(group_rank: int) -> str:
    """A node's worker count, from which every node computes the ranks."""
    return f"elasticd/nproc/{group_rank}"


def alive_key(group_rank: int) -> str:
    """A node's liveness counter, raised about once a second."""
    return f"elasticd/alive/{group_rank}"


def done_key(group_rank: int) -> str:
    """Set by a node at the exit barrier."""
    return f"elasticd/done/{group_rank}"


# per job, outside the rounds


def restarts_key(run_id: str) -> str:
    """The job's restart budget spent so far."""
    return f"elasticd/{run_id}/restarts"


def failure_key(run_id: str) -> str:
    """Why the job failed, for nodes that find the rendezvous closed."""
    return f"elasticd/{run_id}/failure"
