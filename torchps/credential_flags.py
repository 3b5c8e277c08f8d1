"""The credential flags of the commands that call the shards as a client (ps-worker, ps-launch, ps-admin),
defined once: each names the TORCHPS_* variable that stands in for it. Imports neither torch nor grpc."""

from __future__ import annotations

import argparse

from .security import ENV, Security, require_credentials

__all__ = ["add_security_flags", "resolve_security", "ENV_HELP"]

# One line naming every variable, for a command's --help (ps-admin's, above its subcommands).
ENV_HELP = ("credentials: --tls-cert/--tls-key/--tls-ca, --token-file, --admin-token-file, else " +
            ", ".join(f"${name}" for name in ENV.values()) + " (ps-certs makes the files), or --insecure")


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("security (ps-certs makes the files; the TORCHPS_* variables stand in)")
    s.add_argument("--tls-cert", help="this task's certificate ($TORCHPS_TLS_CERT)")
    s.add_argument("--tls-key", help="its key ($TORCHPS_TLS_KEY)")
    s.add_argument("--tls-ca", help="the job's CA certificate ($TORCHPS_TLS_CA)")
    s.add_argument("--token-file", help="this task's token (ps-certs' TYPE-INDEX.token; $TORCHPS_TOKEN_FILE)")
    s.add_argument("--admin-token-file", help="the admin token, the chief's only ($TORCHPS_ADMIN_TOKEN_FILE)")
    s.add_argument("--insecure", action="store_true", help="talk to the shards in plaintext without a token (a "
                   "trusted network only, the shards started --insecure too); needed when no TLS files and no "
                   "token are given")


def resolve_security(args: argparse.Namespace) -> Security:
    """The task's credentials from the flags or the TORCHPS_* variables; ClusterConfigError unless it has some
    or was told --insecure (as ps-server)."""
    return require_credentials(Security.load(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                             token_file=args.token_file, admin_token_file=args.admin_token_file),
                               args.insecure)
