"""A saved wandb workspace with StreamDraft's panels (``trainer.report.panels``).

    python -m trainer.dashboard --entity E --project P [--name NAME] [--ttt-steps 7]
                                [--spec-tokens 5] [--mix-sources chatterbot ...] [--dry-run]

Saving needs wandb credentials (``wandb login`` or ``WANDB_API_KEY``) and network access to the
wandb server; ``--dry-run`` builds the workspace and prints its sections without either.
Needs the ``dashboard`` extra: ``pip install -e .[dashboard]`` (``wandb-workspaces``).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from serving.formats import DEFAULT_SPECULATIVE_TOKENS
from serving.usage import PlainHelp
from trainer.config import DraftConfig, WandbConfig
from trainer.report.panels import X_LABEL, PanelSpec, SectionSpec, sections

DEFAULT_NAME = "StreamDraft"
DEFAULT_MIX_SOURCES = ("chatterbot",)


def _panel(spec: PanelSpec):
    import wandb_workspaces.reports.v2 as wr

    if spec.kind == "bar":
        return wr.BarPlot(title=spec.title, metrics=list(spec.metrics), orientation="h", title_x=spec.y_label)
    return wr.LinePlot(title=spec.title, x="Step", y=list(spec.metrics), title_x=X_LABEL, title_y=spec.y_label)


def _section(spec: SectionSpec, columns: int = 3):
    import wandb_workspaces.workspaces as ws

    panels = [_panel(p) for p in spec.panels if p.metrics]
    rows = -(-len(panels) // columns)
    return ws.Section(name=spec.title, panels=panels, is_open=True, layout_settings=ws.SectionLayoutSettings(columns=columns, rows=rows))


def build_workspace(
    entity: str,
    project: str,
    name: str = DEFAULT_NAME,
    ttt_steps: int = DraftConfig.ttt_steps,
    spec_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    mix_sources: Sequence[str] = DEFAULT_MIX_SOURCES,
):
    """The workspace object (``wandb_workspaces.workspaces.Workspace``); nothing is sent until
    ``.save()``."""
    import wandb_workspaces.workspaces as ws

    if not entity or not project:
        raise ValueError(f"dashboard: entity and project are required (got entity={entity!r}, project={project!r})")
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[_section(s) for s in sections(ttt_steps, spec_tokens, mix_sources)],
        settings=ws.WorkspaceSettings(x_axis="Step"),
    )


def describe(workspace) -> str:
    """The sections, panels and metrics of a built workspace, as text (what --dry-run prints)."""
    import wandb_workspaces.reports.v2 as wr

    lines = [f"workspace {workspace.name!r} for {workspace.entity}/{workspace.project}"]
    for section in workspace.sections:
        lines.append(f"  [{section.name}]")
        for panel in section.panels:
            names = panel.metrics if isinstance(panel, wr.BarPlot) else panel.y
            lines.append(f"    {panel.title}: {', '.join(str(n) for n in names)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.dashboard", description=__doc__.split("\n\n")[0], formatter_class=PlainHelp)
    parser.add_argument("--entity", required=True, help="wandb entity (user or team) that owns the project")
    parser.add_argument("--project", default=WandbConfig.project, help=f"wandb project (default: {WandbConfig.project})")
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"workspace (saved view) name (default: {DEFAULT_NAME})")
    parser.add_argument("--ttt-steps", type=int, default=DraftConfig.ttt_steps, help="draft.ttt_steps of the runs")
    parser.add_argument("--spec-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS, help="draft tokens per verify in eval")
    parser.add_argument("--mix-sources", nargs="*", default=list(DEFAULT_MIX_SOURCES), help="data sources of the mix")
    parser.add_argument("--dry-run", action="store_true", help="build and print the workspace; do not save it")
    args = parser.parse_args(argv)
    workspace = build_workspace(args.entity, args.project, args.name, args.ttt_steps, args.spec_tokens, args.mix_sources)
    print(describe(workspace))
    if not args.dry_run:
        workspace.save()  # prints the view's URL


if __name__ == "__main__":
    main()
