//! One PostgreSQL session over the frontend/backend protocol (v3): connect (TLS, password, MD5
//! or SCRAM-SHA-256), run statements, cancel them.
//!
//! Owns the socket and the protocol state: whether a request is in flight (`busy`), the
//! transaction status of the last `ReadyForQuery`, and whether the session is beyond use. Must
//! not know JSON or HTTP: rows go to an `answer::StatementWriter`, failures come back as
//! `QueryError`. Messages are encoded and decoded by `postgres-protocol`.
//!
//! Why not tokio-postgres: it always asks for binary results (Neon's raw-text answers need
//! PostgreSQL's own text for every type), it hides the transaction status a connection must be
//! checked against before it goes back to the pool, and it does not expose `dataTypeSize`.
//! Statements use the extended protocol as Neon's proxy does: unnamed statement, parameters as
//! text with types left for the server to infer, results as text.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{ErrorResponseBody, Header, Message};
use postgres_protocol::message::frontend;
use postgres_protocol::IsNull;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::answer::{RowError, StatementWriter};
use crate::config::{SslMode, Target};
use crate::error::{DbError, SqlHttpError, TOO_MANY_CONNECTIONS};

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// `ReadyForQuery` transaction status: idle, outside any transaction.
const IDLE: u8 = b'I';

/// Why a statement did not complete.
#[derive(Debug)]
pub(crate) enum QueryError {
    /// PostgreSQL's `ErrorResponse`. The session is still usable unless it was FATAL.
    Db(Box<DbError>),
    /// The answer grew past the cap; the statement still runs and must be cancelled.
    TooLarge,
    /// The socket failed mid-exchange.
    Lost(String),
    /// The server sent something out of order.
    Protocol(String),
    /// The statement could not be encoded (a NUL byte, too many parameters).
    Input(String),
}

/// What cancels this session's running statement: the server's key for it, sent on a new
/// connection to the same target.
#[derive(Clone)]
pub(crate) struct CancelKey {
    target: Arc<Target>,
    process_id: i32,
    secret_key: i32,
}

impl CancelKey {
    /// Sends the protocol's CancelRequest and waits until the server has taken it (it closes
    /// the connection once it has signalled the backend). Best effort: the caller discards the
    /// session anyway, so a cancel that fails only leaves the statement to its timeout.
    pub(crate) async fn cancel(&self) -> Result<(), String> {
        let send = async {
            let mut io = open_stream(&self.target).await?;
            let mut buf = BytesMut::new();
            frontend::cancel_request(self.process_id, self.secret_key, &mut buf);
            io.write_all(&buf).await.map_err(|e| e.to_string())?;
            io.flush().await.map_err(|e| e.to_string())?;
            let mut byte = [0u8; 1];
            let _ = io.read(&mut byte).await;
            Ok(())
        };
        match tokio::time::timeout(self.target.connect_timeout, send).await {
            Ok(result) => result,
            Err(_) => Err("timed out sending the cancel request".into()),
        }
    }
}

/// One authenticated session.
pub(crate) struct Connection {
    io: Box<dyn Io>,
    read_buf: BytesMut,
    write_buf: BytesMut,
    cancel_key: CancelKey,
    /// Largest `DataRow` accepted before the answer is declared too large without reading it.
    max_row_bytes: usize,
    /// Transaction status of the last `ReadyForQuery`.
    status: u8,
    /// A request was sent and its `ReadyForQuery` not yet read: the protocol state is unknown
    /// to anyone but this exchange, so the session cannot be reused if the exchange is dropped.
    busy: bool,
    /// The socket failed or the server ended the session.
    broken: bool,
}

impl Connection {
    /// Opens and authenticates a session. Errors name the redacted target, never the password.
    pub(crate) async fn connect(
        target: Arc<Target>,
        max_row_bytes: usize,
    ) -> Result<Connection, SqlHttpError> {
        let timeout = target.connect_timeout;
        let redacted = target.redacted();
        match tokio::time::timeout(timeout, Self::connect_inner(target, max_row_bytes)).await {
            Ok(result) => result,
            Err(_) => Err(SqlHttpError::Unreachable {
                message: format!(
                    "could not connect to {redacted}: timed out after {} ms",
                    timeout.as_millis()
                ),
            }),
        }
    }

    async fn connect_inner(
        target: Arc<Target>,
        max_row_bytes: usize,
    ) -> Result<Connection, SqlHttpError> {
        let unreachable = |what: &str| SqlHttpError::Unreachable {
            message: format!("could not connect to {}: {what}", target.redacted()),
        };
        let io = open_stream(&target).await.map_err(|e| unreachable(&e))?;
        let mut conn = Connection {
            io,
            read_buf: BytesMut::with_capacity(8192),
            write_buf: BytesMut::with_capacity(1024),
            cancel_key: CancelKey {
                target: target.clone(),
                process_id: 0,
                secret_key: 0,
            },
            max_row_bytes,
            status: IDLE,
            busy: true,
            broken: false,
        };
        conn.startup(&target).await.map_err(|e| match e {
            StartupError::Server(db) if db.code == TOO_MANY_CONNECTIONS => {
                SqlHttpError::TooManyConnections(db)
            }
            StartupError::Server(db) => unreachable(&format!("the server refused: {db}")),
            StartupError::Other(message) => unreachable(&message),
        })?;
        conn.busy = false;
        Ok(conn)
    }

    async fn startup(&mut self, target: &Target) -> Result<(), StartupError> {
        let timeout_ms = target.statement_timeout.map(|t| t.as_millis().to_string());
        let mut params = vec![
            ("user", target.user.as_str()),
            ("database", target.database.as_str()),
            ("application_name", target.application_name.as_str()),
            // Text results are handed to JSON as UTF-8, and the driver parses dates as ISO.
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO, MDY"),
        ];
        if let Some(ms) = timeout_ms.as_deref() {
            params.push(("statement_timeout", ms));
        }
        frontend::startup_message(params, &mut self.write_buf).map_err(StartupError::io)?;
        self.flush().await.map_err(StartupError::io)?;

        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.recv().await.map_err(StartupError::recv)? {
                Message::AuthenticationOk => {}
                Message::AuthenticationCleartextPassword => {
                    let password = password(target)?;
                    frontend::password_message(password.as_bytes(), &mut self.write_buf)
                        .map_err(StartupError::io)?;
                    self.flush().await.map_err(StartupError::io)?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let password = password(target)?;
                    let hash = postgres_protocol::authentication::md5_hash(
                        target.user.as_bytes(),
                        password.as_bytes(),
                        body.salt(),
                    );
                    frontend::password_message(hash.as_bytes(), &mut self.write_buf)
                        .map_err(StartupError::io)?;
                    self.flush().await.map_err(StartupError::io)?;
                }
                Message::AuthenticationSasl(body) => {
                    let mut mechanisms = body.mechanisms();
                    let mut offered = false;
                    while let Some(m) = mechanisms.next().map_err(StartupError::io)? {
                        offered |= m == sasl::SCRAM_SHA_256;
                    }
                    if !offered {
                        return Err(StartupError::Other(
                            "the server offers no SASL mechanism this client speaks".into(),
                        ));
                    }
                    let password = password(target)?;
                    // No channel binding: the server still offers plain SCRAM-SHA-256 to a
                    // client that says it does not bind, and TLS already authenticated it.
                    let s = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
                    frontend::sasl_initial_response(
                        sasl::SCRAM_SHA_256,
                        s.message(),
                        &mut self.write_buf,
                    )
                    .map_err(StartupError::io)?;
                    self.flush().await.map_err(StartupError::io)?;
                    scram = Some(s);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| StartupError::protocol("SASL continue"))?;
                    s.update(body.data()).map_err(StartupError::auth)?;
                    frontend::sasl_response(s.message(), &mut self.write_buf)
                        .map_err(StartupError::io)?;
                    self.flush().await.map_err(StartupError::io)?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let mut s = scram
                        .take()
                        .ok_or_else(|| StartupError::protocol("SASL final"))?;
                    s.finish(body.data()).map_err(StartupError::auth)?;
                }
                Message::BackendKeyData(body) => {
                    self.cancel_key.process_id = body.process_id();
                    self.cancel_key.secret_key = body.secret_key();
                }
                Message::ParameterStatus(_) | Message::NoticeResponse(_) => {}
                Message::ErrorResponse(body) => {
                    return Err(StartupError::Server(Box::new(db_error(&body))));
                }
                Message::ReadyForQuery(body) => {
                    self.status = body.status();
                    return Ok(());
                }
                _ => {
                    return Err(StartupError::protocol(
                        "an unexpected message during startup",
                    ))
                }
            }
        }
    }

    pub(crate) fn cancel_key(&self) -> CancelKey {
        self.cancel_key.clone()
    }

    /// A statement is in flight (its exchange was interrupted if nobody is reading it).
    pub(crate) fn is_busy(&self) -> bool {
        self.busy
    }

    /// Fit to go back to the pool as it is: no exchange in flight, no open transaction, socket
    /// sound. Cheap; `probe` adds a look at the socket.
    pub(crate) fn is_idle(&self) -> bool {
        !self.busy && !self.broken && self.status == IDLE
    }

    /// `is_idle`, and the server has not closed the session while it sat in the pool (idle
    /// timeout, restart, `pg_terminate_backend`): a look at the socket without waiting.
    pub(crate) fn probe(&mut self) -> bool {
        if !self.is_idle() {
            return false;
        }
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut scratch = [0u8; 1024];
        let mut buf = ReadBuf::new(&mut scratch);
        match Pin::new(&mut *self.io).poll_read(&mut cx, &mut buf) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            Poll::Ready(Ok(())) if buf.filled().is_empty() => false,
            Poll::Ready(Ok(())) => {
                // Unprompted messages: a parameter change or notice is harmless; an error means
                // the server is ending the session.
                self.read_buf.extend_from_slice(buf.filled());
                loop {
                    match Message::parse(&mut self.read_buf) {
                        Ok(Some(Message::ErrorResponse(_))) | Err(_) => return false,
                        Ok(Some(_)) => {}
                        Ok(None) => return true,
                    }
                }
            }
        }
    }

    /// Runs one statement with the extended protocol, writing its rows to `writer`, and returns
    /// its command tag (`None` for an empty query).
    pub(crate) async fn query(
        &mut self,
        sql: &str,
        params: &[Option<String>],
        writer: &mut StatementWriter<'_>,
    ) -> Result<Option<String>, QueryError> {
        self.encode_statement(sql, params)?;
        self.send().await?;

        let mut tag = None;
        let mut error: Option<DbError> = None;
        loop {
            match self.recv_in_query().await? {
                // After an ErrorResponse the server skips to Sync: no rows follow an error.
                Message::RowDescription(body) => writer
                    .describe(Some(&body))
                    .map_err(|e| self.protocol(e.to_string()))?,
                Message::NoData => writer
                    .describe(None)
                    .map_err(|e| self.protocol(e.to_string()))?,
                Message::DataRow(row) => match writer.row(&row) {
                    Ok(()) => {}
                    Err(RowError::TooLarge(_)) => return Err(QueryError::TooLarge),
                    Err(RowError::Decode(e)) => return Err(self.protocol(e.to_string())),
                },
                Message::CommandComplete(body) => {
                    let t = body.tag().map_err(|e| self.protocol(e.to_string()))?;
                    tag = Some(t.to_owned());
                }
                Message::EmptyQueryResponse => tag = None,
                Message::ErrorResponse(body) => {
                    let db = db_error(&body);
                    if db.is_fatal() {
                        self.broken = true;
                        return Err(QueryError::Db(Box::new(db)));
                    }
                    error = Some(db);
                }
                Message::CopyInResponse(_) => {
                    // No body to stream from: refuse the copy, the server then reports an error.
                    frontend::copy_fail(
                        "COPY FROM STDIN is not supported over HTTP",
                        &mut self.write_buf,
                    )
                    .map_err(|e| self.lost(&e))?;
                    self.flush().await.map_err(|e| self.lost(&e))?;
                }
                Message::ReadyForQuery(body) => {
                    self.status = body.status();
                    self.busy = false;
                    break;
                }
                // Progress of the exchange, asynchronous notices, COPY TO STDOUT data (dropped).
                _ => {}
            }
        }
        match error {
            Some(db) => Err(QueryError::Db(Box::new(db))),
            None => Ok(tag),
        }
    }

    /// Runs a statement of our own (BEGIN, COMMIT, ROLLBACK) with the simple protocol.
    pub(crate) async fn simple(&mut self, sql: &str) -> Result<(), QueryError> {
        frontend::query(sql, &mut self.write_buf).map_err(|e| QueryError::Input(e.to_string()))?;
        self.send().await?;
        let mut error = None;
        loop {
            match self.recv_in_query().await? {
                Message::ErrorResponse(body) => {
                    let db = db_error(&body);
                    if db.is_fatal() {
                        self.broken = true;
                        return Err(QueryError::Db(Box::new(db)));
                    }
                    error = Some(db);
                }
                Message::ReadyForQuery(body) => {
                    self.status = body.status();
                    self.busy = false;
                    break;
                }
                _ => {}
            }
        }
        match error {
            Some(db) => Err(QueryError::Db(Box::new(db))),
            None => Ok(()),
        }
    }

    fn encode_statement(&mut self, sql: &str, params: &[Option<String>]) -> Result<(), QueryError> {
        let buf = &mut self.write_buf;
        buf.clear();
        let input = |e: io::Error| QueryError::Input(e.to_string());
        // Unnamed statement, no parameter types: the server infers them, as for Neon's proxy.
        frontend::parse("", sql, std::iter::empty(), buf).map_err(input)?;
        // No format codes: every parameter and every result column in text.
        frontend::bind(
            "",
            "",
            std::iter::empty(),
            params,
            |p, buf| match p {
                Some(text) => {
                    buf.put_slice(text.as_bytes());
                    Ok(IsNull::No)
                }
                None => Ok(IsNull::Yes),
            },
            std::iter::empty(),
            buf,
        )
        .map_err(|e| match e {
            frontend::BindError::Conversion(e) => QueryError::Input(e.to_string()),
            frontend::BindError::Serialization(e) => QueryError::Input(e.to_string()),
        })?;
        frontend::describe(b'P', "", buf).map_err(input)?;
        frontend::execute("", 0, buf).map_err(input)?;
        frontend::sync(buf);
        Ok(())
    }

    async fn send(&mut self) -> Result<(), QueryError> {
        self.busy = true;
        self.flush().await.map_err(|e| self.lost(&e))
    }

    async fn flush(&mut self) -> io::Result<()> {
        self.io.write_all(&self.write_buf).await?;
        self.write_buf.clear();
        self.io.flush().await
    }

    async fn recv_in_query(&mut self) -> Result<Message, QueryError> {
        match self.recv().await {
            Ok(m) => Ok(m),
            Err(RecvError::TooLarge) => Err(QueryError::TooLarge),
            Err(RecvError::Io(e)) => Err(self.lost(&e)),
        }
    }

    async fn recv(&mut self) -> Result<Message, RecvError> {
        loop {
            if let Some(header) = Header::parse(&self.read_buf)? {
                // A single row past the cap would have to be buffered whole to be decoded:
                // refuse it from its length alone.
                if header.tag() == b'D'
                    && usize::try_from(header.len()).unwrap_or(usize::MAX) > self.max_row_bytes
                {
                    return Err(RecvError::TooLarge);
                }
            }
            if let Some(message) = Message::parse(&mut self.read_buf)? {
                return Ok(message);
            }
            self.read_buf.reserve(8192);
            if self.io.read_buf(&mut self.read_buf).await? == 0 {
                return Err(RecvError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection",
                )));
            }
        }
    }

    fn lost(&mut self, e: &io::Error) -> QueryError {
        self.broken = true;
        QueryError::Lost(e.to_string())
    }

    fn protocol(&mut self, message: String) -> QueryError {
        self.broken = true;
        QueryError::Protocol(message)
    }
}

impl Drop for Connection {
    /// Says goodbye (`Terminate`) when the session is between exchanges, so the server logs a
    /// clean exit rather than a lost client. Best effort: a write that would wait is skipped.
    fn drop(&mut self) {
        if self.busy || self.broken {
            return;
        }
        let mut buf = BytesMut::new();
        frontend::terminate(&mut buf);
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let _ = Pin::new(&mut *self.io).poll_write(&mut cx, &buf);
        let _ = Pin::new(&mut *self.io).poll_flush(&mut cx);
    }
}

enum RecvError {
    Io(io::Error),
    TooLarge,
}

impl From<io::Error> for RecvError {
    fn from(e: io::Error) -> Self {
        RecvError::Io(e)
    }
}

enum StartupError {
    Server(Box<DbError>),
    Other(String),
}

impl StartupError {
    fn io(e: io::Error) -> Self {
        StartupError::Other(e.to_string())
    }
    fn recv(e: RecvError) -> Self {
        match e {
            RecvError::Io(e) => StartupError::io(e),
            RecvError::TooLarge => StartupError::protocol("an oversized message"),
        }
    }
    fn auth(e: io::Error) -> Self {
        StartupError::Other(format!("SCRAM authentication failed: {e}"))
    }
    fn protocol(what: &str) -> Self {
        StartupError::Other(format!("protocol error: {what}"))
    }
}

fn password(target: &Target) -> Result<&str, StartupError> {
    target.password.as_deref().ok_or_else(|| {
        StartupError::Other("the server asks for a password and the URL has none".into())
    })
}

fn db_error(body: &ErrorResponseBody) -> DbError {
    let mut pairs = Vec::new();
    let mut fields = body.fields();
    // A malformed field list keeps what was read before it.
    while let Ok(Some(field)) = fields.next() {
        pairs.push((
            field.type_(),
            String::from_utf8_lossy(field.value_bytes()).into_owned(),
        ));
    }
    DbError::from_fields(pairs.iter().map(|(k, v)| (*k, v.as_str())))
}

/// TCP, then TLS when the target asks for it (the protocol's SSLRequest first).
async fn open_stream(target: &Target) -> Result<Box<dyn Io>, String> {
    let mut tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| e.to_string())?;
    // Requests are small and answered at once: do not let Nagle hold them back.
    let _ = tcp.set_nodelay(true);
    let Some(tls) = target
        .tls
        .as_ref()
        .filter(|_| target.ssl_mode != SslMode::Disable)
    else {
        return Ok(Box::new(tcp));
    };
    let mut buf = BytesMut::new();
    frontend::ssl_request(&mut buf);
    tcp.write_all(&buf).await.map_err(|e| e.to_string())?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    match answer[0] {
        b'S' => {
            let name = rustls_pki_types::ServerName::try_from(target.host.clone())
                .map_err(|e| format!("TLS server name: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            Ok(Box::new(stream))
        }
        b'N' if target.ssl_mode == SslMode::Prefer => Ok(Box::new(tcp)),
        b'N' => Err("the server does not offer TLS and the URL requires it".into()),
        _ => Err("protocol error: unexpected answer to the TLS request".into()),
    }
}
