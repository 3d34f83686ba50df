//! `DigitsTrainer`: the rank component of the FedAvg example.
//!
//! Each client's group trains on the client's share of the digits training set; each
//! rank takes a strided share of that (local SGD), and the executor's `gather` policy
//! averages the ranks' models weighted by their sample counts. The server then averages
//! the clients' models (FedAvg).
//!
//! Tasks:
//! - `train`: evaluates the received global model on the client's test share
//!   (`val_accuracy`, `val_loss`), trains `epochs` epochs, and returns `weights`, `bias`,
//!   `num_samples` and `train_loss`;
//! - `validate`: evaluates the received model on the client's test share and returns
//!   `accuracy`, `loss` and `num_samples` (the server weights them into the final
//!   metrics).
//!
//! The client's index and the number of clients come from the task context
//! (`__site_index__`, `__num_sites__`, set by the client runtime); the rank and world
//! size from the rank context.

use rankexec_protocol::{
    ComponentError, Executor, FlComponent, FlContext, Shareable, Signal, Value, keys,
};
use serde::Deserialize;

use crate::digits::{self, Data, Model, Partition, Rng};

/// Arguments of `DigitsTrainer`, validated when they are read (so a job's loader and
/// the worker's `--check-components` refuse `lr: -0.5` or `epochs: 0` with the file and
/// the component's JSON path, before any rank starts).
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawTrainerArgs")]
pub struct TrainerArgs {
    /// Local epochs per round (at least 1).
    pub epochs: u32,
    /// Learning rate (positive, finite).
    pub lr: f32,
    /// Mini-batch size (at least 1).
    pub batch_size: usize,
    /// How clients' data is split.
    pub partition: Partition,
    /// The seed of the train/test split (the same on every client).
    pub seed: u64,
    /// Share of the data held out for testing, in (0, 1).
    pub test_fraction: f64,
}

/// The arguments as written, before their values are checked.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrainerArgs {
    /// Local epochs per round.
    #[serde(default = "two")]
    pub epochs: u32,
    /// Learning rate.
    #[serde(default = "digits::defaults::lr")]
    pub lr: f32,
    /// Mini-batch size.
    #[serde(default = "digits::defaults::batch_size")]
    pub batch_size: usize,
    /// How clients' data is split.
    #[serde(default)]
    pub partition: Partition,
    /// The seed of the train/test split (the same on every client).
    #[serde(default = "digits::defaults::seed")]
    pub seed: u64,
    /// Share of the data held out for testing.
    #[serde(default = "digits::defaults::test_fraction")]
    pub test_fraction: f64,
}

fn two() -> u32 {
    2
}

impl TryFrom<RawTrainerArgs> for TrainerArgs {
    type Error = String;

    fn try_from(r: RawTrainerArgs) -> Result<Self, String> {
        digits::check_hyper_parameters(r.epochs, r.lr, r.batch_size, r.test_fraction)?;
        Ok(TrainerArgs {
            epochs: r.epochs,
            lr: r.lr,
            batch_size: r.batch_size,
            partition: r.partition,
            seed: r.seed,
            test_fraction: r.test_fraction,
        })
    }
}

/// The trainer.
pub struct DigitsTrainer {
    args: TrainerArgs,
    train: Data,
    test: Data,
}

impl DigitsTrainer {
    /// Loads the data set once per rank.
    pub fn new(args: TrainerArgs) -> Result<Self, ComponentError> {
        let (train, test) = digits::load(args.seed, args.test_fraction)
            .map_err(|e| ComponentError::failed("cannot load the digits data").with_source(e))?;
        Ok(DigitsTrainer { args, train, test })
    }
}

fn prop_usize(ctx: &FlContext, key: &str, default: usize) -> usize {
    ctx.get_prop(key)
        .and_then(Value::as_i64)
        .map_or(default, |v| v.max(0) as usize)
}

impl FlComponent for DigitsTrainer {}

impl Executor for DigitsTrainer {
    fn execute(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        let site = prop_usize(ctx, keys::SITE_INDEX, 0);
        let sites = prop_usize(ctx, keys::NUM_SITES, 1);
        let rank = prop_usize(ctx, keys::RANK_NUMBER, 0);
        let world = prop_usize(ctx, keys::NUM_OF_PROCESSES, 1);
        let mut model = Model::from_shareable(&input)?;
        let test = digits::client_share(&self.test, site, sites, Partition::Iid);
        let (val_acc, val_loss) = model.evaluate(&test);
        match task {
            "validate" => {
                tracing::info!(
                    site,
                    accuracy = val_acc,
                    loss = val_loss,
                    samples = test.len(),
                    "validated the global model"
                );
                Ok(Shareable::new()
                    .with_meta("accuracy", val_acc)
                    .with_meta("loss", val_loss)
                    .with_meta("num_samples", test.len()))
            }
            "train" => {
                let mine = digits::rank_share(
                    &digits::client_share(&self.train, site, sites, self.args.partition),
                    rank,
                    world,
                );
                if mine.is_empty() {
                    return Err(ComponentError::failed(format!(
                        "site {site} rank {rank} has no training data"
                    )));
                }
                let round = input.meta("round").and_then(Value::as_i64).unwrap_or(0) as u64;
                let mut rng =
                    Rng::new(self.args.seed ^ (round << 32) ^ ((site as u64) << 16) ^ rank as u64);
                tracing::info!(
                    site,
                    round,
                    samples = mine.len(),
                    epochs = self.args.epochs,
                    lr = self.args.lr,
                    val_accuracy = val_acc,
                    "training"
                );
                let loss = model
                    .train(
                        &mine,
                        self.args.epochs,
                        self.args.batch_size,
                        self.args.lr,
                        &mut rng,
                        || abort.is_triggered(),
                    )
                    .ok_or_else(ComponentError::aborted)?;
                tracing::info!(site, round, train_loss = loss, "trained");
                Ok(model
                    .into_shareable(Shareable::new())
                    .with_meta("num_samples", mine.len())
                    .with_meta("train_loss", f64::from(loss))
                    .with_meta("val_accuracy", val_acc)
                    .with_meta("val_loss", val_loss))
            }
            other => Err(ComponentError::failed(format!(
                "unknown task `{other}` (DigitsTrainer runs `train` and `validate`)"
            ))),
        }
    }
}
