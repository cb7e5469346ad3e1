"""The kernel table's rows name the modules that bind them: every row resolves (a typo in a
module path or a binding's name fails here, on the CPU, not first on a CUDA machine), every
binding a module declares has its row, and importing the dispatcher loads no CUDA binding."""

import subprocess
import sys
from importlib import import_module

from veloxquant.kernels import table


def test_every_row_resolves_to_its_modules_binding():
    for kernel in table.KERNELS.values():
        module = import_module(kernel.module)
        assert kernel.name in module.BINDINGS, f"{kernel.module} binds no {kernel.name!r}"
        binding = kernel.binding
        assert binding is module.BINDINGS[kernel.name]
        assert callable(binding.scope) and callable(binding.launch) and callable(binding.prefer)
        assert table.plugin(kernel.name) is module
    assert all(table.KERNELS["lut"].chains) and table.KERNELS["lloyd_encode"].chains == ()


def test_every_binding_has_its_row():
    for module in {k.module for k in table.KERNELS.values()}:
        for name in import_module(module).BINDINGS:
            assert table.KERNELS[name].module == module, f"{module} binds {name!r}, which no row names"


def test_importing_the_dispatcher_loads_no_cuda_binding():
    code = (
        "import sys, veloxquant.kernels.dispatch\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('veloxquant'))))"
    )
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    cuda_only = {k.module for k in table.KERNELS.values() if k.verified == {"cuda"}}
    assert cuda_only and not loaded & cuda_only, loaded & cuda_only
    assert "veloxquant.kernels.dispatch" in loaded
