# Sourced by every command on the lent GPU machine, from the repository root:
# the staged packages on the path (tools/device/stage.sh, receive.sh), pagedkv
# importable from this checkout, logs under /root/logs.
export PYTHONPATH=/root/extsite:/root/fisite:/root/maxsite:/root/pkvsite
export PATH=/root/maxsite/bin:$PATH
export PAGEDKV_CACHE_DIR=/root/pkvcache
export PYTHONUNBUFFERED=1
mkdir -p /root/logs /root/pkvsite
# pagedkv as an installed package would lay it out: its Python files, with
# the kernels (mojo_ops) and the step graphs (graphs) beside them.
# Made once: jobs of earlier calls may be importing from it.
if [ ! -e /root/pkvsite/pagedkv/graphs ]; then
  mkdir -p /root/pkvsite/pagedkv
  ln -sf "$PWD"/python/pagedkv/* /root/pkvsite/pagedkv/
  ln -sfn "$PWD/graphs" /root/pkvsite/pagedkv/graphs
  ln -sfn "$PWD/mojo_ops" /root/pkvsite/pagedkv/mojo_ops
fi

# job NAME COMMAND...: runs COMMAND in its own session (it outlives this
# call), output in /root/logs/NAME.log, exit status in /root/logs/NAME.rc.
job() {
  local name=$1
  shift
  rm -f "/root/logs/$name.rc"
  setsid bash -c '"$@" >"/root/logs/'"$name"'.log" 2>&1; echo $? >"/root/logs/'"$name"'.rc"' _ "$@" &
}

# wait_jobs SECONDS NAME...: waits until every named job has ended or
# SECONDS have passed; prints each one's status and the end of its log.
wait_jobs() {
  local limit=$1
  shift
  local t=0
  while [ "$t" -lt "$limit" ]; do
    local left=0
    for n in "$@"; do [ -f "/root/logs/$n.rc" ] || left=1; done
    [ "$left" = 0 ] && break
    sleep 5
    t=$((t + 5))
  done
  for n in "$@"; do
    echo "=== $n: exit $(cat "/root/logs/$n.rc" 2>/dev/null || echo 'still running')"
    tail -n "${TAIL_LINES:-25}" "/root/logs/$n.log" 2>/dev/null
  done
}

# collect NAME...: copies the named jobs' logs under $OUT (they come back
# with the call's reply, whole, where output_tail holds only the end).
collect() {
  [ -n "${OUT:-}" ] || return 0
  for n in "$@"; do cp "/root/logs/$n.log" "$OUT/" 2>/dev/null; done
  return 0
}
