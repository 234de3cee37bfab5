# Sourced by the launchers: RESUME_ARGS is "resume=auto" unless the user passed a resume= of their own.
# resume=auto continues from the newest complete checkpoint in output_dir, and starts afresh when there is none.
# It also turns llmtrain's guard "output_dir already holds checkpoints" into a resume: a restarted or requeued
# job continues its run instead of refusing to start. Pass resume=null to get the guard back.
# shellcheck disable=SC2034  # read by the script that sources this file
RESUME_ARGS=(resume=auto)
for arg in "$@"; do
  case "$arg" in
    resume=* | +resume=* | ++resume=*) RESUME_ARGS=() ;;
  esac
done
