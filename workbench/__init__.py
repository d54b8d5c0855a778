"""What bench/ and tests/ share, and neither owns: throwaway target environments (envs), the
interpreters they run on (pythons), the released files they start from (release_files), real
OpenSSH servers on 127.0.0.x (sshd), the race stress driver (race_stress), ansible-test's sanity
run (ansible_test_sanity), the release matrix's rules and record (release_matrix), the
environment patcher is started with (patcher_env), long fixtures' progress lines (progress) and
the tiny MoE checkpoints the GPU bench and the tests run (tiny_moe). Not installed with patcher:
a checkout's tools (bench/ and scripts/ put the checkout on sys.path; pytest does for tests/)."""
