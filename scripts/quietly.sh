# Sourced by scripts/test.sh and scripts/demo.sh: run a set-up step with its output held back.
# pip prints every warning of the machine's pip configuration even with -q; a newcomer should see one
# line saying what is being installed, and pip's whole output only when the step fails.
quietly() {  # quietly "what this step does" command [args...]
    local what=$1 log status=0
    shift
    echo "$what"
    log=$(mktemp)
    "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        cat "$log" >&2
        echo "failed (exit $status): $what" >&2
    fi
    rm -f "$log"
    return "$status"
}
