#!/bin/sh
# Runs a command with a private /etc/hosts that also names ::ffff:127.0.0.1 and ::1, when this
# machine allows a private mount namespace (root, `unshare -m`); otherwise runs it unchanged.
#
# Why: c10d formats peer addresses with getnameinfo() without NI_NUMERICHOST. torch's servers
# listen dual-stack, see IPv4 clients as ::ffff:127.0.0.1, which /etc/hosts does not list, and ask
# DNS; where DNS is unreachable that lookup stalls for 5-10 s inside the single-threaded server
# (reference/performance.md §2.1). This is an artefact of the machine, not of the stores under test.
hosts=$(mktemp) || exec "$@"
{ cat /etc/hosts; echo "::ffff:127.0.0.1 localhost"; echo "::1 localhost"; } > "$hosts"
if unshare -m sh -c 'mount --bind "$0" /etc/hosts' "$hosts" 2>/dev/null; then
  exec unshare -m sh -c 'mount --bind "$0" /etc/hosts && rm -f "$0" && shift && exec "$@"' \
    "$hosts" sh "$@"
fi
rm -f "$hosts"
exec "$@"
