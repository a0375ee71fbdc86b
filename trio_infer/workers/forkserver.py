"""Imported only by the fork server that starts worker processes (a preload of the pool's).

A stop signal sent to the whole process group (a terminal's Ctrl+C, systemd's default
``KillMode=control-group``, ``kill -TERM -PGID``) reaches every worker as well as the server.
The server alone decides when workers stop: it lets their calls finish within the grace period,
then shuts them down itself. trio-parallel already ignores SIGINT in workers; SIGTERM is ignored
here, in the fork server, so that it and every worker forked from it inherit the disposition.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
