//! The environment contract between an executor and its ranks, and rank discovery
//! under external launchers.
//!
//! The executor always sets [`vars::ENDPOINT`], [`vars::LAUNCH_ID`] and
//! [`vars::WORLD_SIZE`]. The secret reaches a rank it spawns through an inherited pipe
//! ([`vars::SECRET_FD`]), so it never sits in `/proc/PID/environ`; only ranks started
//! by an external launcher (which passes no descriptors) get [`vars::SECRET`], and it
//! stays in their environment: [`take_secret`] never edits the environment, which is
//! unsound while other threads run. With the built-in launcher it also sets each rank's
//! number ([`vars::RANK`], ...) and [`vars::PARENT_PID`]. Under torchrun, mpirun or srun
//! the launcher sets the rank, and [`discover`] reads it from whichever variables that
//! launcher uses; [`vars::RANK_SOURCE`] can pin which one.

use std::fmt;
use std::str::FromStr;

/// Variable names.
pub mod vars {
    /// Global rank (built-in launcher).
    pub const RANK: &str = "RANKEXEC_RANK";
    /// Local rank on this host (built-in launcher).
    pub const LOCAL_RANK: &str = "RANKEXEC_LOCAL_RANK";
    /// Number of ranks (always set; checked against what a launcher reports).
    pub const WORLD_SIZE: &str = "RANKEXEC_WORLD_SIZE";
    /// Number of ranks on this host (built-in launcher).
    pub const LOCAL_WORLD_SIZE: &str = "RANKEXEC_LOCAL_WORLD_SIZE";
    /// Where to connect (`local:PATH` or `tcp:HOST:PORT`).
    pub const ENDPOINT: &str = "RANKEXEC_ENDPOINT";
    /// The per-launch secret (hex), for ranks an external launcher starts.
    pub const SECRET: &str = "RANKEXEC_SECRET";
    /// The descriptor of an inherited pipe holding the secret (hex), for ranks the
    /// executor spawns itself. Read once, then closed.
    pub const SECRET_FD: &str = "RANKEXEC_SECRET_FD";
    /// The launch id, echoed in every handshake.
    pub const LAUNCH_ID: &str = "RANKEXEC_LAUNCH_ID";
    /// The parent's pid, set only when the parent spawned the rank directly; the rank
    /// then asks for `PR_SET_PDEATHSIG` and checks `getppid()` against it.
    pub const PARENT_PID: &str = "RANKEXEC_PARENT_PID";
    /// Which launcher's variables hold the rank: `auto` (default), `rankexec`,
    /// `torchrun`, `openmpi`, `pmi`, `pmix` or `slurm`.
    pub const RANK_SOURCE: &str = "RANKEXEC_RANK_SOURCE";
    /// The group's log directory; rank `N` writes under `rank-N/` in it.
    pub const LOG_DIR: &str = "RANKEXEC_LOG_DIR";
    /// How long a rank tries to connect and authenticate, in milliseconds.
    pub const CONNECT_TIMEOUT_MS: &str = "RANKEXEC_CONNECT_TIMEOUT_MS";
    /// Where a rank writes a torchrun-style `error.json` when it fails.
    pub const ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
}

/// Why a rank has no secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Neither variable is set.
    #[error("neither {} nor {} is set", vars::SECRET_FD, vars::SECRET)]
    Missing,
    /// The descriptor variable is not a number.
    #[error("{var}={value:?} is not a descriptor number", var = vars::SECRET_FD, value = .0)]
    BadFd(String),
    /// The descriptor cannot be read.
    #[error("cannot read the secret from descriptor {fd}")]
    Read {
        /// The descriptor.
        fd: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// What was read is not a secret.
    #[error("the secret from {0} is not 64 hex digits")]
    Invalid(&'static str),
}

/// The launch secret: read from the pipe at [`vars::SECRET_FD`] (which is then closed)
/// when set, else from [`vars::SECRET`]. `get` reads a variable. The pipe can be taken
/// once per process.
pub fn take_secret(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<crate::wire::Secret, SecretError> {
    if let Some(text) = get(vars::SECRET_FD) {
        let fd: i32 = text
            .trim()
            .parse()
            .map_err(|_| SecretError::BadFd(text.clone()))?;
        let bytes = crate::os::take_inherited_pipe(fd, 256)
            .map_err(|source| SecretError::Read { fd, source })?;
        let hex = String::from_utf8_lossy(&bytes);
        return crate::wire::Secret::from_hex(&hex)
            .map_err(|_| SecretError::Invalid(vars::SECRET_FD));
    }
    let hex = get(vars::SECRET).ok_or(SecretError::Missing)?;
    crate::wire::Secret::from_hex(&hex).map_err(|_| SecretError::Invalid(vars::SECRET))
}

/// Whose variables carry the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankSource {
    /// `RANKEXEC_*` (the built-in launcher).
    Rankexec,
    /// torchrun: `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`.
    Torchrun,
    /// Open MPI: `OMPI_COMM_WORLD_{RANK,LOCAL_RANK,SIZE,LOCAL_SIZE}`.
    OpenMpi,
    /// MPICH/Hydra and srun `--mpi=pmi2`: `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
    Pmi,
    /// PMIx: `PMIX_RANK` (the size comes from `RANKEXEC_WORLD_SIZE`).
    Pmix,
    /// Slurm: `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`, `SLURM_STEP_TASKS_PER_NODE`.
    Slurm,
}

impl RankSource {
    /// The order `auto` tries, most specific first: a launcher nested inside another
    /// (torchrun under srun, mpirun inside a Slurm allocation) sets its own variables
    /// per rank, while the outer one's are the same for every rank on the host.
    pub const AUTO_ORDER: [RankSource; 6] = [
        RankSource::Rankexec,
        RankSource::Torchrun,
        RankSource::OpenMpi,
        RankSource::Pmi,
        RankSource::Pmix,
        RankSource::Slurm,
    ];

    /// The variable that holds the global rank.
    pub fn rank_var(self) -> &'static str {
        match self {
            RankSource::Rankexec => vars::RANK,
            RankSource::Torchrun => "RANK",
            RankSource::OpenMpi => "OMPI_COMM_WORLD_RANK",
            RankSource::Pmi => "PMI_RANK",
            RankSource::Pmix => "PMIX_RANK",
            RankSource::Slurm => "SLURM_PROCID",
        }
    }

    /// A lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            RankSource::Rankexec => "rankexec",
            RankSource::Torchrun => "torchrun",
            RankSource::OpenMpi => "openmpi",
            RankSource::Pmi => "pmi",
            RankSource::Pmix => "pmix",
            RankSource::Slurm => "slurm",
        }
    }
}

impl fmt::Display for RankSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RankSource {
    type Err = RankEnvError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RankSource::AUTO_ORDER
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| RankEnvError::Invalid {
                var: vars::RANK_SOURCE,
                value: s.to_owned(),
            })
    }
}

/// A rank's place in its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank.
    pub rank: u32,
    /// Rank on this host.
    pub local_rank: u32,
    /// Number of ranks.
    pub world_size: u32,
    /// Number of ranks on this host.
    pub local_world_size: u32,
    /// Where it was read from.
    pub source: RankSource,
}

/// Why a rank could not tell who it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankEnvError {
    /// No launcher's variables are set.
    #[error("no rank in the environment (looked for {tried})")]
    Missing {
        /// The variables tried.
        tried: String,
    },
    /// A variable does not parse.
    #[error("{var}={value:?} is not valid")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    OutOfRange {
        /// The rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// The launcher's world size differs from the executor's.
    #[error("{launcher} reports world size {reported} but the executor expects {expected}")]
    WorldMismatch {
        /// Where the rank came from.
        launcher: RankSource,
        /// What the launcher says.
        reported: u32,
        /// What the executor set.
        expected: u32,
    },
}

fn num(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<u32>, RankEnvError> {
    match get(var) {
        None => Ok(None),
        Some(v) => {
            // Slurm writes per-node counts like "2(x3)"; the leading number is ours.
            let digits: String = v
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            digits
                .parse::<u32>()
                .map(Some)
                .map_err(|_| RankEnvError::Invalid { var, value: v })
        }
    }
}

fn read_source(
    get: &dyn Fn(&str) -> Option<String>,
    source: RankSource,
    expected_world: Option<u32>,
) -> Result<Option<RankEnv>, RankEnvError> {
    let (rank_var, local_var, world_var, local_world_var): (
        _,
        Option<&'static str>,
        Option<&'static str>,
        Option<&'static str>,
    ) = match source {
        RankSource::Rankexec => (
            vars::RANK,
            Some(vars::LOCAL_RANK),
            Some(vars::WORLD_SIZE),
            Some(vars::LOCAL_WORLD_SIZE),
        ),
        RankSource::Torchrun => (
            "RANK",
            Some("LOCAL_RANK"),
            Some("WORLD_SIZE"),
            Some("LOCAL_WORLD_SIZE"),
        ),
        RankSource::OpenMpi => (
            "OMPI_COMM_WORLD_RANK",
            Some("OMPI_COMM_WORLD_LOCAL_RANK"),
            Some("OMPI_COMM_WORLD_SIZE"),
            Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
        ),
        RankSource::Pmi => (
            "PMI_RANK",
            Some("MPI_LOCALRANKID"),
            Some("PMI_SIZE"),
            Some("MPI_LOCALNRANKS"),
        ),
        RankSource::Pmix => ("PMIX_RANK", None, None, None),
        RankSource::Slurm => (
            "SLURM_PROCID",
            Some("SLURM_LOCALID"),
            Some("SLURM_NTASKS"),
            Some("SLURM_STEP_TASKS_PER_NODE"),
        ),
    };
    let Some(rank) = num(get, rank_var)? else {
        return Ok(None);
    };
    let reported = match world_var {
        Some(v) => num(get, v)?,
        None => None,
    };
    let world_size = match (reported, expected_world) {
        (Some(r), Some(e)) if r != e => {
            return Err(RankEnvError::WorldMismatch {
                launcher: source,
                reported: r,
                expected: e,
            });
        }
        (Some(r), _) => r,
        (None, Some(e)) => e,
        (None, None) => {
            return Err(RankEnvError::Missing {
                tried: format!("{} (world size)", world_var.unwrap_or(vars::WORLD_SIZE)),
            });
        }
    };
    if rank >= world_size {
        return Err(RankEnvError::OutOfRange { rank, world_size });
    }
    let local_rank = match local_var {
        Some(v) => num(get, v)?.unwrap_or(rank),
        None => rank,
    };
    let local_world_size = match local_world_var {
        Some(v) => num(get, v)?.unwrap_or(world_size),
        None => world_size,
    };
    Ok(Some(RankEnv {
        rank,
        local_rank,
        world_size,
        local_world_size,
        source,
    }))
}

/// Reads this process's rank through `get` (usually `std::env::var(..).ok()`).
///
/// ```
/// use rankexec_protocol::env::{discover, RankSource};
/// let env = |k: &str| match k {
///     "OMPI_COMM_WORLD_RANK" => Some("1".to_owned()),
///     "OMPI_COMM_WORLD_SIZE" => Some("2".to_owned()),
///     "RANKEXEC_WORLD_SIZE" => Some("2".to_owned()),
///     _ => None,
/// };
/// let r = discover(&env).unwrap();
/// assert_eq!((r.rank, r.world_size, r.source), (1, 2, RankSource::OpenMpi));
/// ```
pub fn discover(get: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv, RankEnvError> {
    let expected = num(get, vars::WORLD_SIZE)?;
    let pinned = match get(vars::RANK_SOURCE) {
        None => None,
        Some(s) if s == "auto" || s.is_empty() => None,
        Some(s) => Some(s.parse::<RankSource>()?),
    };
    let order: Vec<RankSource> = match pinned {
        Some(p) => vec![p],
        None => RankSource::AUTO_ORDER.to_vec(),
    };
    for source in &order {
        if let Some(env) = read_source(get, *source, expected)? {
            return Ok(env);
        }
    }
    Err(RankEnvError::Missing {
        tried: order
            .iter()
            .map(|s| s.rank_var())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    type Case<'a> = (&'a [(&'a str, &'a str)], RankSource, (u32, u32, u32, u32));

    #[test]
    fn each_launcher_is_read() {
        let cases: [Case<'_>; 6] = [
            (
                &[
                    ("RANKEXEC_RANK", "2"),
                    ("RANKEXEC_LOCAL_RANK", "0"),
                    ("RANKEXEC_WORLD_SIZE", "4"),
                    ("RANKEXEC_LOCAL_WORLD_SIZE", "2"),
                ],
                RankSource::Rankexec,
                (2, 0, 4, 2),
            ),
            (
                &[
                    ("RANK", "3"),
                    ("LOCAL_RANK", "1"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                RankSource::Torchrun,
                (3, 1, 4, 2),
            ),
            (
                &[
                    ("OMPI_COMM_WORLD_RANK", "1"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                    ("OMPI_COMM_WORLD_SIZE", "2"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
                ],
                RankSource::OpenMpi,
                (1, 1, 2, 2),
            ),
            (
                &[
                    ("PMI_RANK", "5"),
                    ("MPI_LOCALRANKID", "1"),
                    ("PMI_SIZE", "8"),
                    ("MPI_LOCALNRANKS", "4"),
                ],
                RankSource::Pmi,
                (5, 1, 8, 4),
            ),
            (
                &[("PMIX_RANK", "1"), ("RANKEXEC_WORLD_SIZE", "2")],
                RankSource::Pmix,
                (1, 1, 2, 2),
            ),
            (
                &[
                    ("SLURM_PROCID", "6"),
                    ("SLURM_LOCALID", "2"),
                    ("SLURM_NTASKS", "8"),
                    ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
                ],
                RankSource::Slurm,
                (6, 2, 8, 4),
            ),
        ];
        for (pairs, source, (r, lr, w, lw)) in cases {
            let got = discover(&env(pairs)).unwrap();
            assert_eq!(got.source, source);
            assert_eq!(
                (
                    got.rank,
                    got.local_rank,
                    got.world_size,
                    got.local_world_size
                ),
                (r, lr, w, lw),
                "{source}"
            );
        }
    }

    #[test]
    fn torchrun_wins_over_an_enclosing_slurm_step() {
        let got = discover(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap();
        assert_eq!((got.rank, got.source), (1, RankSource::Torchrun));
    }

    #[test]
    fn pinned_source_and_errors() {
        let pinned = discover(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("RANKEXEC_RANK_SOURCE", "slurm"),
        ]))
        .unwrap();
        assert_eq!((pinned.rank, pinned.source), (0, RankSource::Slurm));
        assert_eq!(
            discover(&env(&[])).unwrap_err().to_string(),
            "no rank in the environment (looked for RANKEXEC_RANK, RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK, SLURM_PROCID)"
        );
        assert_eq!(
            discover(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err(),
            RankEnvError::Invalid {
                var: "RANK",
                value: "x".into()
            }
        );
        assert_eq!(
            discover(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err(),
            RankEnvError::OutOfRange {
                rank: 2,
                world_size: 2
            }
        );
        assert!(matches!(
            discover(&env(&[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "3"),
                ("RANKEXEC_WORLD_SIZE", "2")
            ])),
            Err(RankEnvError::WorldMismatch {
                reported: 3,
                expected: 2,
                ..
            })
        ));
    }
}
