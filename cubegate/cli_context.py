"""The one context object every `cubegate` command group gets as click's ctx.obj.

It carries the global options, loads the settings once (on first use, so
`--help` needs no valid settings file) and answers what the groups that may
not import cubegate ask of their parent by attribute: `vault_db`,
`vault_key_file`, `host_policy_check` (vault.cli.VaultCliHost) and `audit_dir`
(egress.audit.cli). It lives apart from cli.py so that groups defined in other
modules (sandbox_cli) import it, not the command tree that mounts them.
"""
from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from cubegate.settings import Settings


class CliContext:
    def __init__(self, config: str | None = None, state_dir: str | None = None):
        self.config = config
        self.state_dir = state_dir

    @cached_property
    def settings(self) -> Settings:
        from cubegate.settings import SettingsError, load_settings   # pydantic: only for commands that need settings

        try:
            return load_settings(self.config, state_dir=self.state_dir)
        except SettingsError as e:
            raise click.ClickException(str(e)) from None

    # ------------------------------------------------ for groups that may not import us
    @property
    def audit_dir(self) -> str:
        return str(self.settings.audit_dir)

    @property
    def vault_db(self) -> str:
        return str(self.settings.vault_db)

    @property
    def vault_key_file(self) -> str:
        return str(self.settings.vault_key_file)

    @property
    def host_policy_check(self):
        """A binding's host must be one the policy could allow (checked when it is added; the
        policy code is imported then, not by every vault command)."""
        policy_dir = self.settings.policy_dir

        def current():
            from egress.policy import PolicyError, load_policy_dir
            try:
                return load_policy_dir(policy_dir)
            except PolicyError as e:
                raise click.ClickException(f"cannot check binding against policy: {e}")

        def check(tenant: str, host: str) -> str | None:
            from egress.credentials import host_policy_check_for
            return host_policy_check_for(current)(tenant, host)
        return check

    def open_vault(self):
        """The vault, unsealed with the one key precedence (vault.keysource)."""
        import vault as vaultlib
        v = vaultlib.Vault.open(self.settings.vault_db)
        try:
            vaultlib.unseal_from(v, self.settings.vault_key_file)
        except vaultlib.VaultError:
            v.close()
            raise
        return v


def cli_context(ctx: click.Context) -> CliContext:
    obj = ctx.find_object(CliContext)
    if obj is None:   # a group invoked on its own (tests, embedding): defaults + environment
        obj = ctx.find_root().ensure_object(CliContext)
    return obj
