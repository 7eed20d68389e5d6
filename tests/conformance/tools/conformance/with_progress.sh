#!/bin/sh
# Progress lines go to the descriptor toolsetd names; 0, 50 and 100 of 100, 50 ms apart.
# (/dev/fd/N: dash takes no descriptor above 9 in a redirection.)
progress="/dev/fd/${TOOLSETD_PROGRESS_FD:?}"
printf '%s\n' '{"fraction": 0, "message": "started"}' >>"$progress"
sleep 0.05
printf '%s\n' '{"fraction": 0.5, "message": "halfway"}' >>"$progress"
sleep 0.05
printf '%s\n' '{"fraction": 1, "message": "done"}' >>"$progress"
echo "Progress reported: 0, 50, 100 of 100."
