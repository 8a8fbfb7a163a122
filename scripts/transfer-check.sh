#!/usr/bin/env bash
# 100 MiB upload, then download, through a running broker binary, timed by curl: a quick
# check of the transfer paths outside `make bench`.
#   scripts/transfer-check.sh target/release/codebroker
set -euo pipefail
BIN=$1; D=$(mktemp -d); PORT=${PORT:-18777}
head -c $((100 << 20)) /dev/urandom > "$D/big.bin"
CODEBROKER_AUTH=none CODEBROKER_DATA_DIR="$D/data" CODEBROKER_LISTEN=127.0.0.1:$PORT \
  CODEBROKER_POOL_SIZE=0 CODEBROKER_INSTANCE=transfer-check "$BIN" > "$D/log" 2>&1 &
PID=$!; trap 'kill $PID; rm -rf "$D"' EXIT
for _ in $(seq 50); do curl -fs "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.2; done
for _ in 1 2 3; do
  up=$(curl -fs -w '\n%{time_total}' -F entity_id=e1 -F file=@"$D/big.bin" "http://127.0.0.1:$PORT/upload")
  body=$(echo "$up" | head -1); t_up=$(echo "$up" | tail -1)
  ids=$(echo "$body" | python3 -c 'import sys, json; j = json.load(sys.stdin); print(j["session_id"], j["files"][0]["fileId"])')
  t_down=$(curl -fs -o "$D/out.bin" -w '%{time_total}' "http://127.0.0.1:$PORT/download/${ids% *}/${ids#* }")
  cmp -s "$D/big.bin" "$D/out.bin" && same="same bytes" || same="DIFFERENT BYTES"
  awk -v u="$t_up" -v d="$t_down" -v s="$same" \
    'BEGIN { printf "upload %.2f s (%.0f MB/s), download %.2f s (%.0f MB/s), %s\n", u, 104.8576 / u, d, 104.8576 / d, s }'
done
