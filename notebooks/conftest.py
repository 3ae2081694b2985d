"""pytest --nbmake on these notebooks (`make test`, `make test-notebooks`): each kernel starts as `make demo` starts
it, over the ipc transport (``logbook.kernel_config``), so ipykernel does not warn "Kernel is running over TCP without
encryption" once per notebook. nbmake builds its ``NotebookClient`` itself and takes no kernel config, hence the
name swapped in its module."""

try:
    from nbmake import nb_run
except ImportError:  # pytest without nbmake: nothing runs a kernel here
    nb_run = None

from gemma_tpu_helpers.course.front import logbook

if nb_run is not None:
    nb_run.NotebookClient = logbook.notebook_client
