#!/usr/bin/env bash
# One curl per language against a running broker.
#   CODEBROKER_URL=http://127.0.0.1:8000 CODEBROKER_API_KEY=secret examples/curl.sh
set -euo pipefail
URL=${CODEBROKER_URL:-http://127.0.0.1:8000}
KEY=${CODEBROKER_API_KEY:-}

run() { # lang, code
  local body
  body=$(python3 -c 'import json,sys; print(json.dumps({"lang": sys.argv[1], "code": sys.argv[2]}))' "$1" "$2")
  printf '%-5s ' "$1"
  curl -fsS "$URL/v1/exec" -H 'Content-Type: application/json' ${KEY:+-H "X-API-Key: $KEY"} -d "$body" \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); print(repr(r["stdout"]), "exit", r["exit_code"], r["stderr"][:200] if r["exit_code"] else "")'
}

run py   'import sys; print("hello from", sys.version.split()[0])'
run js   'console.log("hello from node", process.version)'
run ts   'const n: number = 42; console.log(`hello from ts ${n}`)'
run c    '#include <stdio.h>
int main(void) { puts("hello from c"); return 0; }'
run cpp  '#include <iostream>
int main() { std::cout << "hello from c++" << std::endl; }'
run java 'public class Hello { public static void main(String[] a) { System.out.println("hello from java"); } }'
run php  '<?php echo "hello from php ", PHP_VERSION, "\n";'
run rs   'fn main() { println!("hello from rust"); }'
run go   'package main
import "fmt"
func main() { fmt.Println("hello from go") }'
run d    'import std.stdio; void main() { writeln("hello from d"); }'
run f90  'program hello
  print *, "hello from fortran"
end program hello'
run r    'cat("hello from R", R.version$major, "\n")'
run bash 'echo "hello from bash $BASH_VERSION"'
