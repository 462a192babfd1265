#!/usr/bin/env bash
# On the lent GPU machine, once per part of tools/device/stage.sh's pack:
# keeps the carried part; as soon as FlashInfer's part is complete, installs
# it and starts its JIT builds in the background; once every part is there,
# installs MAX, the extras and the model, and checks that MAX sees the GPU.
#
#   bash tools/device/receive.sh N      # N: the number of parts
set -uo pipefail
total=$1
stage=/root/devstage
mkdir -p "$stage/parts"
cp .devstage/p*/part-* "$stage/parts/" 2>/dev/null
have=$(ls "$stage/parts" | wc -l)
echo "have $have of $total parts"
# The members complete so far (the last one may be cut off: tar says so).
(cd "$stage" && cat parts/part-* | tar -x -f - 2>/dev/null)
source tools/device/env.sh
if [ ! -d /root/fisite ] && xz -t "$stage/fisite.tar.xz" 2>/dev/null; then
  xz -dc "$stage/fisite.tar.xz" | tar -x -C /root
  nproc
  for part in decode decode-tc mla append; do
    job "fi-$part" python3 tools/device/flashinfer_warm.py "$part"
  done
  echo "FlashInfer's JIT builds started"
fi
[ "$have" -lt "$total" ] && exit 0
for site in extsite maxsite; do
  [ -d "/root/$site" ] || xz -dc "$stage/$site.tar.xz" | tar -x -C /root
done
mkdir -p "$PAGEDKV_CACHE_DIR" && cp -r --update=none "$stage/model/." "$PAGEDKV_CACHE_DIR/"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
# pagedkv's own dependencies and its serving extra import (a missing one fails
# every model test, so it is named here first).
python3 -c "import gguf, tokenizers, jinja2, llguidance, fastapi, uvicorn, openai" || exit 1
python3 -c "import max.driver as d, torch, pagedkv; print('MAX sees', d.accelerator_count(), 'GPU(s); torch', torch.__version__, torch.cuda.get_device_name())"
[ -d /root/fisite ] && for part in decode decode-tc mla append; do
  echo "fi-$part: $(cat /root/logs/fi-$part.rc 2>/dev/null || echo running) $(tail -n 1 /root/logs/fi-$part.log 2>/dev/null)"
done
exit 0
