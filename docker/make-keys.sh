#!/bin/sh
# make-keys.sh DIR NAME=IP... — the ssh material of one compose topology, made once per
# volume (the `keys` service): a client key (the only key the rank hosts accept), one
# host key per rank host, a known_hosts naming each host by name and address, and the
# ssh client config the control host uses (batch mode, timeouts, keep-alives).
# Mirrors what tests/netns/hosts.py generates per test run.
set -eu
dir=$1
shift
umask 077
mkdir -p "$dir"
[ -f "$dir/client_ed25519" ] ||
  ssh-keygen -q -t ed25519 -N "" -C lockstep-compose-client -f "$dir/client_ed25519"
: > "$dir/known_hosts.tmp"
names=""
for pair in "$@"; do
  name=${pair%%=*}
  ip=${pair#*=}
  mkdir -p "$dir/$name"
  [ -f "$dir/$name/ssh_host_ed25519_key" ] ||
    ssh-keygen -q -t ed25519 -N "" -C "lockstep-compose-$name" -f "$dir/$name/ssh_host_ed25519_key"
  echo "$name,$ip $(cut -d' ' -f1,2 "$dir/$name/ssh_host_ed25519_key.pub")" >> "$dir/known_hosts.tmp"
  names="$names $name $ip"
done
mv "$dir/known_hosts.tmp" "$dir/known_hosts"
cat > "$dir/ssh_config" <<CONF
Host$names
  User root
  IdentityFile $dir/client_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $dir/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
  ServerAliveInterval 5
  ServerAliveCountMax 3
CONF
chmod 644 "$dir/client_ed25519.pub" "$dir/known_hosts" "$dir/ssh_config"
echo "ssh material for:$names in $dir"
