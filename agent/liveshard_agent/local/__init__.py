"""`liveshard-local`: a job as local processes, the job's driver where the operator is absent.

It sits beside the server, above the runtime: the runtime never imports it (an import-linter
contract). `launcher` is the driver and the command, `job` the job it runs, `process` a member's
process, `start` how such processes start, `output` what it prints, `faults` the `--kill` harness.
It carries no test hooks of its own: tests install theirs from the test side, as a picklable
`LocalJob.hooks` factory.
"""
