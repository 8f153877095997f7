"""`liveshard-local`: a job as local processes, the job's driver where the operator is absent.

It sits beside the server, above the runtime: the runtime never imports it (an import-linter
contract), and it carries no test hooks of its own; tests install theirs from the test side.
"""
