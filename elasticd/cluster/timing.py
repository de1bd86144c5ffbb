"""How often and how long the control plane's protocol looks and waits (rendezvous.py and its
parts, peers.py): one place for its pacing. Plain numbers, torch-free: beats, `LOST_SILENCE`,
polls, waits (`LOOK_WAIT` says why a key nodes wait on is never read first), `CLOCK_SKEW`,
`HOST_DOWN_POLL`, and a follower's wait for the c10d host's answer (`HOST_ANSWER`, `ANSWER_POLL`,
`ANSWER_EVERY`).
"""

BEAT_EVERY = 0.25  # seconds between a node's liveness beats
LOST_SILENCE = 1.25  # seconds of silence that, with evidence, make a node lost (five beats missed)
CLOSE_POLL = 0.05  # how often the node closing a round looks at the arrivals
BARRIER_GRACE = 2.0  # seconds before a node that was not last at the exit barrier checks it itself
WAIT_SLICE = 1.0  # seconds a blocking wait lasts before its caller looks around (stop, closed job)
# A key that nodes wait on is never read before a wait has said that it is there: torch's libuv
# TCPStore server (2.13) wakes every client waiting on a key when any client compare-and-sets it
# while it is missing, which is how kv.get reads. Such a read wakes all the waiters (the key still
# missing), each of them reads it in turn and wakes the others again: with N nodes waiting on a
# round's members that was a quarter of a million requests for one round of 1024 nodes
# (bench/scale.py). So the node closing a round pauses in a wait on the members key instead of
# reading it, the exit barrier looks for a restart request with a short wait, and a wait that
# returns without a value that verifies is followed by a pause.
LOOK_WAIT = 0.05  # seconds of a wait that only asks whether a key is there yet
# seconds nodes' clocks may differ: a job's end issued earlier than our start less this is old
CLOCK_SKEW = 60.0
# seconds a node that follows a c10d store's host gives the host to answer its challenge in a run
# before it says so and looks again; how often it looks; how often the host reads the challenges
HOST_ANSWER = 2.0
ANSWER_POLL = 0.02
ANSWER_EVERY = 0.05
# the longest pause between reads of a key that holds a value that does not verify
GARBAGE_BACKOFF = 2.0
# seconds between tries at a c10d store whose host refuses the connection (its daemon is down,
# maybe being started again): a refused connect costs nothing, and the restarted host's first
# round waits only --last-call-timeout for more nodes once MIN have come
HOST_DOWN_POLL = 0.25
