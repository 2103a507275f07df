#!/usr/bin/env bash
# Run the whole test suite (junit XML report in test-results.xml), then pack the code and one edition's writeup
# PDF (writeup/writeup_2026.pdf or writeup/writeup.pdf, stored as writeup.pdf at the top of the zip: the handout
# asks for it with the code) into cs336-spring<edition>-assignment-2-submission.zip. The zip is built even when
# tests fail, so that partial work can still be handed in; the script's exit status is the test run's. Left out,
# as the 2026 course script leaves them out: caches, logs, pickles, .txt and .json files, model files; also
# writeup/build/ (the writeup's staging directory), the git-ignored smoke-run results under .scratch/, traces and
# files over 5 MB.
set -uo pipefail
cd "$(dirname "$0")"

usage() {
    cat <<'USAGE'
usage: bash test_and_make_submission.sh [--edition 2025|2026] [--skip-tests]

Runs the test suite (8.5 minutes on 2 idle CPU cores, more on busy ones; junit report in test-results.xml), then writes
cs336-spring<edition>-assignment-2-submission.zip: the code and that edition's writeup PDF as writeup.pdf
(2026: writeup/writeup_2026.pdf; 2025: writeup/writeup.pdf), without caches, logs, pickles, .txt and .json files,
model files, traces, .scratch/ and files over 5 MB. The exit status is the test run's.

  --edition E    the handout answered: 2026 (default, the release whose pins we follow) or 2025
  --skip-tests   pack the zip without running the tests (exit status 0)
  -h, --help     show this message
USAGE
}

run_tests=1
edition=2026
while [[ $# -gt 0 ]]; do
    case "$1" in
        --skip-tests) run_tests=0 ;;
        --edition)
            if [[ $# -lt 2 || ! "$2" =~ ^(2025|2026)$ ]]; then
                echo "--edition takes 2025 or 2026" >&2; usage >&2; exit 2
            fi
            edition=$2; shift ;;
        --edition=2025|--edition=2026) edition=${1#--edition=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

if [[ $run_tests == 1 ]]; then
    uv run pytest -v ./tests --junitxml=test-results.xml
    test_status=$?
    summary="Tests exited with status $test_status"
else
    test_status=0
    summary="Tests skipped (--skip-tests)"
fi

pdf=writeup/writeup_2026.pdf
[[ $edition == 2025 ]] && pdf=writeup/writeup.pdf
output=cs336-spring$edition-assignment-2-submission.zip
rm -f "$output"
zip -q -r "$output" . \
    -x '.git' '.git/*' '.venv/*' '*/.venv/*' '*__pycache__*' '*.pytest_cache*' '*.egg-info*' \
       'build/*' 'dist/*' '*.pyc' '*.so' '*.pkl' '*.pickle' '*.pt' '*.pth' '*.ckpt' '*.safetensors' \
       '*.nsys-rep' '*.qdrep' '*.sqlite' '*.trace.json' '*.json.gz' 'traces/*' 'snapshots/*' \
       '*.zip' '*.tar' '*.tar.gz' '*.npy' '*.bin' '.gl/*' '.whl/*' '*.txt' '*.json' '*.log' \
       'writeup/build/*' 'writeup/writeup*.pdf' '.scratch/*' \
    -x@<(find . -type f -size +5M -not -path './.git/*' -not -path './.venv/*' | sed 's|^\./||')
if [[ -f $pdf ]]; then
    staged=$(mktemp -d)
    cp "$pdf" "$staged/writeup.pdf"
    zip -q -j "$output" "$staged/writeup.pdf"
    rm -r "$staged"
else
    echo "warning: $pdf is missing (build it: uv run python writeup/build.py)" >&2
fi
echo "$summary; wrote $output ($(du -h "$output" | cut -f1)) with $pdf as writeup.pdf"
exit "$test_status"
