# sha1 (12 hex digits) of the Python files under exl3_jax/, ffi/, models/ and scripts/, in path
# order: pre.sh prints it on the device, so a call's log names the code it ran; run it here on a
# commit to match.
find exl3_jax ffi models scripts -name '*.py' -type f 2>/dev/null | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12
