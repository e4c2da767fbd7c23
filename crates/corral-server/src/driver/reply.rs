//! The reply as it is put together, whichever API it goes out in: its text, reasoning and
//! tool calls, and the events that built it (a part opened, grew, closed). Every renderer
//! reads these, so the rules of a reply (a part at a time, a call's arguments joining to the
//! whole call's, a call cut short left incomplete) live here once.

use corral_engine::TokenEvent;

use super::generation::unique_suffix;
use crate::output::Delta;

/// A part of a reply: the reasoning, the answer text, or a tool call (by its index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Reasoning,
    Text,
    Call(usize),
}

/// What a step did to the reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReplyEvent {
    /// A part began (a call: its id and name are known).
    Open(Part),
    /// A part grew by this text (a call: by a piece of its arguments).
    More(Part, String),
    /// A part ended (a call: complete, or cut short when [`Call::complete`] is false).
    Close(Part),
}

/// A tool call of the reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    /// Its id, which the client's result for it names.
    pub(crate) id: String,
    /// The function called.
    pub(crate) name: String,
    /// Its arguments as JSON text (so far, while it is written).
    pub(crate) arguments: String,
    /// Whether the call was written to its end.
    pub(crate) complete: bool,
}

/// A reply being put together.
#[derive(Debug)]
pub(crate) struct Reply {
    /// The answer text.
    pub(crate) text: String,
    /// The reasoning.
    pub(crate) reasoning: String,
    calls: Vec<Call>,
    /// Log-probabilities of the reply's tokens, where asked for.
    pub(crate) logprobs: Vec<TokenEvent>,
    open: Option<Part>,
    /// How this API's call ids begin (`call`, `toolu`).
    call_prefix: &'static str,
}

impl Reply {
    /// An empty reply whose calls get ids starting with `call_prefix`.
    pub(crate) fn new(call_prefix: &'static str) -> Self {
        Self {
            text: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            logprobs: Vec::new(),
            open: None,
            call_prefix,
        }
    }

    /// The calls written to their end.
    pub(crate) fn calls(&self) -> impl Iterator<Item = &Call> {
        self.calls.iter().filter(|c| c.complete)
    }

    /// A call by index (complete or not).
    pub(crate) fn call(&self, index: usize) -> &Call {
        &self.calls[index]
    }

    fn close(&mut self, events: &mut Vec<ReplyEvent>) {
        if let Some(part) = self.open.take() {
            events.push(ReplyEvent::Close(part));
        }
    }

    fn open(&mut self, part: Part, events: &mut Vec<ReplyEvent>) {
        if self.open != Some(part) {
            self.close(events);
            self.open = Some(part);
            events.push(ReplyEvent::Open(part));
        }
    }

    fn begin_call(&mut self, name: String, events: &mut Vec<ReplyEvent>) -> usize {
        let index = self.calls.len();
        self.calls.push(Call {
            id: format!("{}_{}", self.call_prefix, unique_suffix()),
            name,
            arguments: String::new(),
            complete: false,
        });
        self.open(Part::Call(index), events);
        index
    }

    /// Adds the parser's deltas; returns what they did, in order.
    pub(crate) fn push(&mut self, deltas: Vec<Delta>) -> Vec<ReplyEvent> {
        let mut events = Vec::new();
        for delta in deltas {
            match delta {
                Delta::Content(t) if !t.is_empty() => {
                    self.open(Part::Text, &mut events);
                    self.text.push_str(&t);
                    events.push(ReplyEvent::More(Part::Text, t));
                }
                Delta::Reasoning(t) if !t.is_empty() => {
                    self.open(Part::Reasoning, &mut events);
                    self.reasoning.push_str(&t);
                    events.push(ReplyEvent::More(Part::Reasoning, t));
                }
                Delta::Content(_) | Delta::Reasoning(_) => {}
                Delta::ToolCallName(name) => {
                    self.begin_call(name, &mut events);
                }
                Delta::ToolCallArguments(more) => {
                    if let Some(Part::Call(i)) = self.open {
                        self.calls[i].arguments.push_str(&more);
                        events.push(ReplyEvent::More(Part::Call(i), more));
                    }
                }
                Delta::ToolCall { name, arguments } => {
                    let index = match self.open {
                        // A streamed call: its pieces came before; the whole call's
                        // arguments are what they join to.
                        Some(Part::Call(i)) => i,
                        _ => {
                            let i = self.begin_call(name, &mut events);
                            events.push(ReplyEvent::More(Part::Call(i), arguments.clone()));
                            i
                        }
                    };
                    let call = &mut self.calls[index];
                    call.arguments = arguments;
                    call.complete = true;
                    self.close(&mut events);
                }
            }
        }
        events
    }

    /// Closes what is open at the reply's end.
    pub(crate) fn end(&mut self) -> Vec<ReplyEvent> {
        let mut events = Vec::new();
        self.close(&mut events);
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts open and close one at a time; a streamed call's pieces and a whole call give
    /// the same open / more / close events; a call cut short closes incomplete and is not
    /// among the reply's calls.
    #[test]
    fn parts_open_grow_and_close_one_at_a_time() {
        let mut r = Reply::new("call");
        let mut events = r.push(vec![
            Delta::Reasoning("plan".into()),
            Delta::Content(String::new()),
            Delta::Content("Sure.".into()),
            Delta::ToolCallName("f".into()),
            Delta::ToolCallArguments("{\"a\":".into()),
        ]);
        events.extend(r.push(vec![
            Delta::ToolCallArguments("1}".into()),
            Delta::ToolCall {
                name: "f".into(),
                arguments: "{\"a\":1}".into(),
            },
            Delta::ToolCall {
                name: "g".into(),
                arguments: "{}".into(),
            },
            Delta::ToolCallName("h".into()),
        ]));
        events.extend(r.end());
        use ReplyEvent::*;
        assert_eq!(
            events,
            [
                Open(Part::Reasoning),
                More(Part::Reasoning, "plan".into()),
                Close(Part::Reasoning),
                Open(Part::Text),
                More(Part::Text, "Sure.".into()),
                Close(Part::Text),
                Open(Part::Call(0)),
                More(Part::Call(0), "{\"a\":".into()),
                More(Part::Call(0), "1}".into()),
                Close(Part::Call(0)),
                Open(Part::Call(1)),
                More(Part::Call(1), "{}".into()),
                Close(Part::Call(1)),
                Open(Part::Call(2)),
                Close(Part::Call(2)),
            ]
        );
        let calls: Vec<(&str, &str)> = r
            .calls()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("f", "{\"a\":1}"), ("g", "{}")]);
        assert!(!r.call(2).complete);
        assert!(r.call(0).id.starts_with("call_") && r.call(0).id != r.call(1).id);
        assert_eq!((r.text.as_str(), r.reasoning.as_str()), ("Sure.", "plan"));
    }
}
