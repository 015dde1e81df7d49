# Sourced by the script tests. expect NAME STATUS TEXT CMD...: runs CMD and
# checks its exit status and that its output (stdout and stderr) contains
# TEXT; prints "ok   NAME" or what went wrong, and counts failures in
# $failures.
failures=0

expect() {
  local name=$1 status=$2 text=$3
  shift 3
  local out code
  out=$("$@" 2>&1)
  code=$?
  if [ "$code" -ne "$status" ] || ! grep -qF -- "$text" <<<"$out"; then
    echo "FAIL $name: status $code (expected $status), output:"
    echo "$out" | sed 's/^/    /'
    echo "  expected to contain: $text"
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}
