#!/usr/bin/env bash
# Issue 13's six speed goals, each by its own benchmark, one after the other in one run: the
# figures a closing note reports. ~4 minutes here with Paddle, plus ~7 the first time (the
# sources are made in AOA_GOALS_WORK and kept for the next run).
#
#     bench/goals.sh                  # this checkout's .venv, log on stdout
#     bench/goals.sh OTHER/bin/python # the aoa that interpreter imports
#
# Needs Paddle's environment for goals 1 and 2 (/work/paddle-venv, see README.md); each
# benchmark prints its own ratios side by side with its yardstick, measured in this run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
work=${AOA_GOALS_WORK:-/tmp/aoa-goals}
mkdir -p "$work"
# As a wheel's install does: a session with PYTHONDONTWRITEBYTECODE=1 would otherwise compile
# aoa from source in every command it times.
"$python" -m compileall -q "$("$python" -c 'import aoa, os; print(os.path.dirname(aoa.__file__))')"

section() { printf '\n## %s (%s; %s)\n' "$1" "$(date -u +%H:%M:%S)" "$(cut -d' ' -f1-3 /proc/loadavg)"; }

# These VMs page out what is left alone for a minute (DAMON): convert.py reads goal 3's
# source into the page cache before each repeat, and both it and small_tensors.py run one
# command untimed first.

section "goal 1: the drop-in, 61x256 and PaddleFormers' programs"
"$python" bench/dropin.py --rounds 3
section "goal 2: compile + plan + lower at 61x256"
# Best of three, Paddle and aoa alternating (compile_scale.py's default at this size is one
# of each, to save Paddle's 11 s): one sample of aoa's 0.6 s ranged 0.57-0.81 s between runs.
"$python" bench/compile_scale.py --sizes 61x256 --repeats 3
section "goal 3: the command against dd oflag=direct, 1.55 GB"
"$python" bench/convert.py --command-only --repeats 3 --work "$work/conv8"
section "goal 3: the same, 3.2 GB"
"$python" bench/convert.py --command-only --layers 17 --repeats 1 --work "$work/conv17"
section "goal 3: the same, 6.16 GB"
"$python" bench/convert.py --command-only --layers 34 --repeats 1 --work "$work/conv34"
section "goal 4: 31k small tensors, the command against compile"
"$python" bench/small_tensors.py --repeats 3 --work "$work/small"
section "goal 5: cold sources against dd iflag=direct, 1.55 GB"
"$python" bench/convert.py --cold --repeats 3 --work "$work/conv8"
section "goal 6: start-up"
"$python" bench/startup.py
section "done"
