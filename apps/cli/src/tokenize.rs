//! `deltafin tokenize`: encode text, or render a chat, with a model's tokenizer.
//!
//! Stable forms (used by tools outside the project):
//!
//! ```text
//! deltafin tokenize --model DIR --text TEXT [--special] --json
//!     {"ids": [...]}
//! deltafin tokenize --model DIR --chat-file MESSAGES.json [--no-thinking] [--effort low|high|max]
//!                   [--tools-file TOOLS.json] --json
//!     {"text": "...", "ids": [...]}
//! ```
//!
//! `MESSAGES.json` is an OpenAI `messages` array (or an object with a `messages`
//! field); `TOOLS.json` is an OpenAI `tools` array. The chat form appends the
//! generation prompt. Without `--json` the output is plain text for people.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use deltafin_text::chat::{self, ChatOptions, Message, ThinkingEffort, Tool};
use deltafin_text::tokenizer::Tokenizer;

/// Encode text, or render a chat as a K3 prompt, with a model's tokenizer.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "chat_file"])))]
pub struct TokenizeArgs {
    /// Model directory holding `tiktoken.model` and `tokenizer_config.json`.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,

    /// Text to encode (may start with `-`: the next argument is always the text).
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    pub text: Option<String>,

    /// Recognise special tokens such as `<|open|>` in `--text` (default: plain text).
    #[arg(long, conflicts_with = "chat_file")]
    pub special: bool,

    /// Render this conversation (an OpenAI `messages` JSON array) as a K3 prompt.
    #[arg(long, value_name = "MESSAGES.json")]
    pub chat_file: Option<PathBuf>,

    /// Render with thinking off (no think elements; the prompt opens a response).
    #[arg(long, conflicts_with = "text")]
    pub no_thinking: bool,

    /// Thinking effort announced when thinking is on (default: max).
    #[arg(long, value_name = "low|high|max", conflicts_with = "text", value_parser = parse_effort)]
    pub effort: Option<ThinkingEffort>,

    /// Tool declarations (an OpenAI `tools` JSON array).
    #[arg(long, value_name = "TOOLS.json", conflicts_with = "text")]
    pub tools_file: Option<PathBuf>,

    /// Print JSON: `{"ids": [...]}`, or `{"text": ..., "ids": [...]}` for a chat.
    #[arg(long)]
    pub json: bool,
}

fn parse_effort(value: &str) -> Result<ThinkingEffort, String> {
    value.parse().map_err(|e: chat::TextError| e.to_string())
}

/// Runs the subcommand, printing to stdout.
pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let text = output(&args)?;
    let mut out = std::io::stdout().lock();
    // A reader that closed the pipe early is not an error.
    match std::io::Write::write_all(&mut out, format!("{text}\n").as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    Ok(())
}

/// What [`run`] prints (without the final newline).
pub fn output(args: &TokenizeArgs) -> anyhow::Result<String> {
    let tokenizer = Tokenizer::from_dir(&args.model)
        .with_context(|| format!("loading the tokenizer from {}", args.model.display()))?;

    if let Some(text) = &args.text {
        let ids = if args.special {
            tokenizer.encode_with_specials(text)
        } else {
            tokenizer.encode(text)
        };
        return Ok(if args.json {
            serde_json::to_string(&IdsOut { ids: &ids })?
        } else {
            join_ids(&ids)
        });
    }

    let chat_file = args
        .chat_file
        .as_deref()
        .context("either --text or --chat-file is required")?;
    let messages = read_messages(chat_file)?;
    let mut options = ChatOptions {
        thinking: !args.no_thinking,
        ..ChatOptions::default()
    };
    if let Some(effort) = args.effort {
        options.thinking_effort = Some(effort);
    }
    if let Some(tools_file) = &args.tools_file {
        options.tools = read_json::<Vec<Tool>>(tools_file)?;
    }
    let rendered = chat::render(&tokenizer, &messages, &options)
        .with_context(|| format!("rendering {}", chat_file.display()))?;
    Ok(if args.json {
        serde_json::to_string(&ChatOut {
            text: &rendered.text,
            ids: &rendered.ids,
        })?
    } else {
        format!("{}\n{}", rendered.text, join_ids(&rendered.ids))
    })
}

#[derive(serde::Serialize)]
struct IdsOut<'a> {
    ids: &'a [u32],
}

#[derive(serde::Serialize)]
struct ChatOut<'a> {
    text: &'a str,
    ids: &'a [u32],
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// A `messages` array, or an object carrying one (an OpenAI request body).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum MessagesFile {
    Messages(Vec<Message>),
    Request { messages: Vec<Message> },
}

fn read_messages(path: &Path) -> anyhow::Result<Vec<Message>> {
    Ok(match read_json::<MessagesFile>(path)? {
        MessagesFile::Messages(messages) | MessagesFile::Request { messages } => messages,
    })
}
