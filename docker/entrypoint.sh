#!/bin/sh
# entrypoint.sh [control|rank-host|tests] COMMAND... — prepare this container as the
# host LOCKSTEP_ROLE names, then exec COMMAND. The ssh material comes from the `keys`
# service (docker/make-keys.sh) on the shared volume LOCKSTEP_SSH_DIR.
set -eu
ssh_dir=${LOCKSTEP_SSH_DIR:-/lockstep-ssh}
role=${LOCKSTEP_ROLE:-}

install_client() {
  # The control host (and the test runner) ssh to the rank hosts with the generated
  # key, the generated known_hosts and batch mode: never a prompt.
  install -m 600 "$ssh_dir/ssh_config" /root/.ssh/config
}

case "$role" in
  control)
    install_client
    mkdir -p "$LOCKSTEP_HOME" && chmod 700 "$LOCKSTEP_HOME"
    if [ "${LOCKSTEP_KEYGEN:-0}" = 1 ] && [ ! -f "$LOCKSTEP_HOME/keys/cluster.key" ]; then
      lockstep keygen --home "$LOCKSTEP_HOME"
    fi
    ;;
  rank-host)
    name=${LOCKSTEP_HOST_NAME:?LOCKSTEP_HOST_NAME is not set}
    install -m 600 "$ssh_dir/$name/ssh_host_ed25519_key" /etc/ssh/ssh_host_ed25519_key
    install -m 644 "$ssh_dir/$name/ssh_host_ed25519_key.pub" /etc/ssh/ssh_host_ed25519_key.pub
    install -m 600 "$ssh_dir/client_ed25519.pub" /root/.ssh/authorized_keys
    cat > /etc/ssh/sshd_config.d/lockstep.conf <<CONF
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
X11Forwarding no
AllowTcpForwarding no
ClientAliveInterval 5
ClientAliveCountMax 3
CONF
    mkdir -p /run/sshd "$LOCKSTEP_HOME" && chmod 700 "$LOCKSTEP_HOME"
    ;;
  tests)
    install_client
    ;;
  "") ;;
  *) echo "entrypoint: unknown LOCKSTEP_ROLE '$role'" >&2; exit 2 ;;
esac
exec "$@"
