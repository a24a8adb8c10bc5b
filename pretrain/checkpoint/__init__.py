"""The checkpoint wing: what a run leaves on disk. The run directory and its atomic files (`rundir`),
saving in the background (`saving`), the states beside the engine's (`states`), the manager that
saves, verifies, resumes and consolidates (`manager`), and conversion to another layout (`reshard`)."""
