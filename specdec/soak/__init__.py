"""``specdec soak``: a long, disturbed run of the whole stack that must lose nothing.

C clients send a mix of requests (greedy and sampled, streams cancelled
mid-way, client deadlines from 1 ms up, malformed requests) for D seconds
while a drafter, a verifier and the orchestrator are killed (SIGKILL) and
restarted at intervals. The report counts every request by outcome and
flags what a user would call a loss or a leak: an unexpected status, a
greedy output that differs from its reference, a session still open on a
backend after the load, a process whose memory grew past a threshold.

Modules: ``stack`` (the processes, on fixed ports so a restart comes back
at the same address), ``load`` (the request mix and how each outcome is
judged), ``report`` (figures, text and JSON) and ``run`` (the schedule).

May import: ``specdec.procs``, the SDK, the core packages. Never the CLI.
"""
