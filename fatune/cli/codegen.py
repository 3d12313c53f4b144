"""`fatune codegen`: show exactly the kernel source that will run (either kernel family's)."""

from __future__ import annotations

from pathlib import Path

import click

from fatune.cli.options import (
    kernel_spec_options,
    launch_config_options,
    parse_capability,
)
from fatune.kernel.family import FAMILIES, family
from fatune.kernel.gluon.family import default_backward, default_forward
from fatune.kernel.gluon.launch import backward_untemplated, untemplated
from fatune.kernel.spec import KernelSpec, LaunchConfig
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.structure import with_runnable_split_d


@click.command()
@kernel_spec_options
@launch_config_options
@click.option("--kernel", type=click.Choice(["fwd", "bwd", "all"]), default="all", show_default=True,
              help="Which generated module to show.")
@click.option("--arch", default="9.0", show_default=True, callback=parse_capability,
              help="Compute capability whose heuristic config fills unset --fwd/--dkdv/--dq.")
@click.option("--group", type=click.IntRange(1, 65536), default=1, show_default=True,
              help="GQA group the call has (query heads per key/value head): the heuristic's choice can depend on it.")
@click.option("--family", "family_name", type=click.Choice(sorted(FAMILIES)), default="triton", show_default=True,
              help="Kernel family: triton, or gluon (the Hopper forward and backward with their built-in configs; "
                   "the Triton backward where the Gluon one does not serve the spec).")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              help="Write attn_fwd.py / attn_bwd.py into this folder instead of printing.")
def codegen(head_dim: int, head_dim_v: int, dtype: str, causal: bool,
            fwd_config: LaunchConfig | None, dkdv_config: LaunchConfig | None, dq_config: LaunchConfig | None,
            kernel: str, arch: tuple[int, int], group: int, family_name: str, output: Path | None) -> None:
    """Print (or write) the generated kernel source for one kernel spec and launch config.

    Example:

        fatune codegen --head-dim 64 --dtype bf16 --causal --fwd 128x64/w4/s3
        fatune codegen --head-dim 128 --dtype bf16 --family gluon --kernel fwd
    """
    spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal)
    config = default_config(spec, arch, group=group)
    overrides = {"fwd": fwd_config, "dkdv": dkdv_config, "dq": dq_config}
    try:
        config = config.replace(**{name: value for name, value in overrides.items() if value is not None})
    except (ValueError, TypeError) as error:  # configs each valid on their own that cannot run together
        given = " ".join(f"--{name} {value}" for name, value in overrides.items() if value is not None)
        raise click.UsageError(f"{given}: {error}") from None
    config = with_runnable_split_d(config, spec)  # as a launch runs it
    if family_name == "gluon":
        for name, given in (("fwd", fwd_config), ("dkdv", dkdv_config)):
            if given is not None:
                raise click.UsageError(f"--{name} {given}: a Triton config; --family gluon renders the Gluon "
                                       f"kernels' built-in configs")
        # the kernel asked for must be the family's; with --kernel all, a backward it does not serve is Triton's
        why = backward_untemplated(spec) if kernel == "bwd" else untemplated(spec)
        if why is not None:
            raise click.UsageError(f"--family gluon: {why}")
        config = config.replace(fwd=default_forward(spec))
        if backward_untemplated(spec) is None:
            config = config.replace(dkdv=default_backward(spec))
    kinds = ["fwd", "bwd"] if kernel == "all" else [kernel]
    for kind in kinds:
        source = family(family_name).render(kind, spec, config)
        if output is None:
            click.echo(source, nl=False)
            continue
        path = output / f"attn_{kind}.py"
        try:
            output.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
        except OSError as error:
            raise click.ClickException(f"-o {output}: cannot write {path.name} ({error.strerror or error})") from None
        click.echo(f"wrote {path}")
