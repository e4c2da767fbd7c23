//! The one generation driver every endpoint shares: it runs a [`Generation`], folds its
//! steps into a [`Reply`], and hands what changed to the endpoint's [`Render`], which alone
//! knows its wire format: a whole response body, or a stream of server-sent events.

mod generation;
mod reply;

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::Json;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use corral_engine::TokenEvent;
use serde_json::Value;

pub(crate) use generation::{End, Finish, Generation, Step, Usage, response_id, unix_now};
pub(crate) use reply::{Call, Part, Reply, ReplyEvent};

use crate::error::ApiError;

/// One server-sent event of a stream.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Frame {
    /// Data only (OpenAI's chunks).
    Data(Value),
    /// A named event (Anthropic's and the Responses API's).
    Named(String, Value),
    /// OpenAI's `[DONE]`.
    Done,
}

impl Frame {
    fn into_sse(self) -> SseEvent {
        match self {
            Frame::Data(data) => SseEvent::default().data(data.to_string()),
            Frame::Named(name, data) => SseEvent::default().event(name).data(data.to_string()),
            Frame::Done => SseEvent::default().data("[DONE]"),
        }
    }
}

/// One wire format's side of a reply.
pub(crate) trait Render: Send + 'static {
    /// The frames that open a stream, before any token.
    fn opening(&mut self, _g: &Generation) -> Vec<Frame> {
        Vec::new()
    }

    /// A step's frames: what it did to the reply, and its tokens' log-probabilities.
    fn step(
        &mut self,
        g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        logprobs: &[TokenEvent],
    ) -> Vec<Frame>;

    /// The frames that end a stream: the last step's events, then the end.
    fn ending(
        &mut self,
        g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        end: &End,
    ) -> Vec<Frame>;

    /// The frames that report a failure in the middle of a stream.
    fn failure(&mut self, g: &Generation, reply: &Reply, error: &ApiError) -> Vec<Frame>;

    /// The whole response, when it is not streamed.
    fn body(&mut self, g: &Generation, reply: &Reply, end: &End) -> Value;
}

/// Runs `g` to its end and answers with `render`'s body, or streams its frames.
pub(crate) async fn respond<R: Render>(
    mut g: Generation,
    mut reply: Reply,
    mut render: R,
    stream: bool,
) -> Result<Response, ApiError> {
    if !stream {
        loop {
            match g.next().await? {
                Some(Step::Tokens { deltas, logprobs }) => {
                    reply.push(deltas);
                    reply.logprobs.extend(logprobs);
                }
                Some(Step::Finished { deltas, end }) => {
                    reply.push(deltas);
                    reply.end();
                    return Ok(Json(render.body(&g, &reply, &end)).into_response());
                }
                None => return Err(ApiError::internal("generation ended without a result")),
            }
        }
    }
    let pending: VecDeque<Frame> = render.opening(&g).into();
    let driver = Streaming {
        generation: Some(g),
        reply,
        render,
        pending,
    };
    let events = futures_util::stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(frame) = d.pending.pop_front() {
                return Some((Ok::<_, Infallible>(frame.into_sse()), d));
            }
            if !d.advance().await {
                return None;
            }
        }
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// A streamed reply in progress.
struct Streaming<R> {
    generation: Option<Generation>,
    reply: Reply,
    render: R,
    pending: VecDeque<Frame>,
}

impl<R: Render> Streaming<R> {
    /// Queues the frames of the next step; false at the end.
    async fn advance(&mut self) -> bool {
        let Some(g) = self.generation.as_mut() else {
            return false;
        };
        let frames = match g.next().await {
            Ok(Some(Step::Tokens { deltas, logprobs })) => {
                let events = self.reply.push(deltas);
                self.render.step(g, &self.reply, &events, &logprobs)
            }
            Ok(Some(Step::Finished { deltas, end })) => {
                let mut events = self.reply.push(deltas);
                events.extend(self.reply.end());
                let frames = self.render.ending(g, &self.reply, &events, &end);
                self.generation = None;
                frames
            }
            Ok(None) => {
                self.generation = None;
                Vec::new()
            }
            Err(e) => {
                let frames = self.render.failure(g, &self.reply, &e);
                self.generation = None;
                frames
            }
        };
        self.pending.extend(frames);
        true
    }
}
