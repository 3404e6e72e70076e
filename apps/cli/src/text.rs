//! Text in and out of `deltafin run`: prompt encoding (plain or K3 chat), streaming decode with reasoning and
//! answer shown apart, and a Ctrl-C flag that stops generation cleanly.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use deltafin_runtime::Engine;
use deltafin_text::chat::{
    self, ChatEvent, ChatOptions, Message, OutputParser, ParserStart, ThinkingEffort,
};
use deltafin_text::tokenizer::StreamDecoder;

/// How `--prompt` is turned into tokens and generated tokens into text.
#[derive(Clone, Debug)]
pub enum TextMode {
    /// The prompt is raw text; output is decoded as it comes.
    Plain,
    /// The prompt is one user message in K3's XTML chat format.
    Chat {
        /// Thinking phase on.
        thinking: bool,
        /// Thinking effort (low, high, max).
        effort: Option<String>,
    },
}

fn parse_effort(effort: Option<&str>) -> anyhow::Result<Option<ThinkingEffort>> {
    Ok(match effort {
        None | Some("max") => Some(ThinkingEffort::Max),
        Some("high") => Some(ThinkingEffort::High),
        Some("low") => Some(ThinkingEffort::Low),
        Some(other) => bail!("--effort must be low, high or max, got `{other}`"),
    })
}

/// The prompt's token ids.
pub fn encode_prompt(engine: &Engine, text: &str, mode: &TextMode) -> anyhow::Result<Vec<u32>> {
    let tok = engine.require_tokenizer()?;
    match mode {
        TextMode::Plain => Ok(tok.encode(text)),
        TextMode::Chat { thinking, effort } => {
            let options = ChatOptions {
                thinking: *thinking,
                thinking_effort: parse_effort(effort.as_deref())?,
                ..ChatOptions::default()
            };
            let rendered = chat::render(tok, &[Message::user(text)], &options)
                .context("rendering the chat prompt")?;
            Ok(rendered.ids)
        }
    }
}

/// Prints generated tokens as text; in chat mode, reasoning (dimmed, under a "thinking" header) and the answer
/// are separated.
pub struct TextPrinter {
    kind: PrinterKind,
    out: std::io::Stdout,
    in_reasoning: bool,
    /// Reasoning is dimmed only where stdout may take colour ([`crate::out::colour`]).
    dim: &'static str,
    reset: &'static str,
}

enum PrinterKind {
    Plain(StreamDecoder),
    Chat(Box<OutputParser>),
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

impl TextPrinter {
    /// A printer for `mode`.
    pub fn new(engine: &Engine, mode: &TextMode) -> anyhow::Result<Self> {
        let tok = Arc::clone(engine.require_tokenizer()?);
        let colour = crate::out::colour(std::io::IsTerminal::is_terminal(&std::io::stdout()));
        let kind = match mode {
            TextMode::Plain => PrinterKind::Plain(StreamDecoder::new(tok)),
            TextMode::Chat { thinking, .. } => PrinterKind::Chat(Box::new(
                OutputParser::new(tok, ParserStart::for_thinking(*thinking))
                    .context("the model's tokenizer lacks K3's chat markup")?,
            )),
        };
        Ok(Self {
            kind,
            out: std::io::stdout(),
            in_reasoning: false,
            dim: if colour { DIM } else { "" },
            reset: if colour { RESET } else { "" },
        })
    }

    /// Prints what `id` completes. Returns `false` when output can no longer be written or the turn ended.
    pub fn push(&mut self, id: u32) -> bool {
        let mut text = String::new();
        let mut ended = false;
        match &mut self.kind {
            PrinterKind::Plain(d) => text = d.push(id).unwrap_or_default(),
            PrinterKind::Chat(p) => {
                for event in p.push(id).unwrap_or_default() {
                    match event {
                        ChatEvent::Reasoning(r) => {
                            if !self.in_reasoning {
                                text.push_str(&format!("{}[thinking]\n", self.dim));
                                self.in_reasoning = true;
                            }
                            text.push_str(&r);
                        }
                        ChatEvent::Content(c) => {
                            if self.in_reasoning {
                                text.push_str(&format!("{}\n[answer]\n", self.reset));
                                self.in_reasoning = false;
                            }
                            text.push_str(&c);
                        }
                        ChatEvent::ToolCall(call) => {
                            text.push_str(&format!(
                                "\n[tool call] {}({})\n",
                                call.name, call.arguments
                            ));
                        }
                        ChatEvent::End => ended = true,
                    }
                }
            }
        }
        let mut lock = self.out.lock();
        let written = lock
            .write_all(text.as_bytes())
            .and_then(|_| lock.flush())
            .is_ok();
        written && !ended
    }

    /// Flushes whatever is pending and ends the line.
    pub fn finish(&mut self) {
        let mut rest = match &mut self.kind {
            PrinterKind::Plain(d) => d.finish(),
            PrinterKind::Chat(p) => p
                .finish()
                .into_iter()
                .map(|e| match e {
                    ChatEvent::Reasoning(t) | ChatEvent::Content(t) => t,
                    _ => String::new(),
                })
                .collect(),
        };
        if self.in_reasoning {
            rest.push_str(self.reset);
        }
        rest.push('\n');
        let mut lock = self.out.lock();
        // Nothing more can be done about a closed stdout at the end of a run.
        let _ = lock.write_all(rest.as_bytes()).and_then(|_| lock.flush());
    }
}

/// A flag set by Ctrl-C (installed once). Generation checks it after each token, so a run stops within one
/// token and still prints and saves what it produced.
pub fn ctrl_c_flag() -> Arc<AtomicBool> {
    use std::sync::OnceLock;
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    Arc::clone(FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let f = Arc::clone(&flag);
        if let Err(e) = ctrlc::set_handler(move || f.store(true, Ordering::Relaxed)) {
            tracing::warn!("cannot install the Ctrl-C handler: {e}");
        }
        flag
    }))
}
